"""sfi.mode lossless over HTTP on the CPU: start the OpenAI-compatible server with the embedded
SmolLM2 as its own drafter, send greedy chat completions (one with a per-request SFI budget, one
with an engine-wide field, which must get a 400), and print the answers and the server's SFI and
speculative-decoding metrics.

    .venv/bin/python benchmarks/lossless_serve_cpu.py [--port 8031]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def post(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return 200, json.loads(urllib.request.urlopen(req, timeout=600).read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from sfi_vllm.tools.model_prep import prepare_model

    model = str(prepare_model(progress=False))
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="sfi-prom-"),
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--max-model-len", "2048", "--port", str(args.port), "--attention-backend", "sfi",
           "--additional-config", json.dumps({"sfi": {"mode": "lossless", "selected_tokens": 32, "recent_window": 32}}),
           "--speculative-config", json.dumps(spec)]
    log = open(tempfile.mktemp(prefix="sfi-lossless-serve-", suffix=".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                print(f"server exited {proc.returncode}; log: {log.name}")
                return 1
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                break
            except Exception:
                time.sleep(2)
        print(f"server up in {time.time() - t0:.0f} s", flush=True)
        question = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
        base = {"model": model, "messages": question, "temperature": 0, "max_tokens": args.max_tokens}
        for name, extra in (("engine settings", {}), ("sfi_selected_tokens 16", {"vllm_xargs": {"sfi_selected_tokens": 16}}),
                            ("sfi_mode (engine-wide)", {"vllm_xargs": {"sfi_mode": "lossy"}})):
            t = time.time()
            code, resp = post(args.port, {**base, **extra})
            if code == 200:
                text = resp["choices"][0]["message"]["content"]
                print(json.dumps({"request": name, "status": code, "seconds": round(time.time() - t, 1),
                                  "completion_tokens": resp["usage"]["completion_tokens"], "text": text}), flush=True)
            else:
                print(json.dumps({"request": name, "status": code, "error": resp.get("error", resp)}), flush=True)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{args.port}/metrics", timeout=10).read().decode()
        keep = ("sfi_verify", "sfi_drafted", "sfi_accepted", "sfi_slow_steps", "sfi_fast_steps",
                "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")
        for line in scrape.splitlines():
            if line.startswith(keep):
                print(line)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
