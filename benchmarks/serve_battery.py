"""A battery of OpenAI-API requests against the CPU server, dense then SFI lossless then SFI lossy
(one server at a time), each answer compared with dense's: greedy completions with the sampling
fields users send (logprobs, prompt_logprobs, echo, stop strings and ids, min_tokens, penalties,
logit_bias, chat, streaming with and without usage, structured outputs (JSON schema, choice,
regex), beam search, n 2 sampled, min_p, logprob_token_ids, a seeded request twice), per-request SFI
settings, malformed SFI settings (each must get
a 400 naming the field), prompts too long or empty, a client that leaves mid-stream, six concurrent
requests with mixed settings, then /health and the server's SFI metrics.

    .venv/bin/python benchmarks/serve_battery.py --out benchmarks/results/serve-battery-cpu.jsonl

Prints one line per request and server, and the comparison table (markdown) at the end; a cell
also gives the completion tokens counted in ``usage`` where they differ from dense's.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# the lossless engine's working set is small (4 + 32 + 32 tokens), so that drafts are rejected
SMALL = {"sinks": 4, "recent_window": 32, "selected_tokens": 32}


def engines(model: str) -> dict[str, list[str]]:
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 8}
    return {
        "dense": [],
        "lossless": ["--attention-backend", "sfi", "--additional-config", json.dumps({"sfi": {**SMALL, "mode": "lossless"}}),
                     "--speculative-config", json.dumps(spec)],
        "lossy": ["--attention-backend", "sfi"],
    }


def cases(model: str, long: str) -> dict[str, tuple[str, dict]]:
    def comp(prompt: str, max_tokens: int = 48, **kw) -> tuple[str, dict]:
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}

    def chat(text: str, **kw) -> tuple[str, dict]:
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": 48, "temperature": 0, **kw}

    short = "The capital of France is"
    return {
        "greedy, long prompt": comp(long, 96),
        "greedy, short prompt": comp(short, 32),
        "one-token prompt": comp("Hi", 16),
        "max_tokens 1": comp(long, 1),
        "max_tokens 2": comp(long, 2),
        "n 2, sampled": comp(long, 24, n=2, temperature=0.8),
        "logprobs 3": comp(long, 12, logprobs=3),
        "prompt_logprobs 1": comp(short, 4, prompt_logprobs=1),
        "echo": comp(short, 8, echo=True),
        "stop string": comp(long, 96, stop=["."]),
        "stop token id": comp(long, 96, stop_token_ids=[13]),
        "min_tokens": comp("Hi", 24, min_tokens=20),
        "penalties": comp(long, 48, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
        "logit_bias": comp(short, 8, logit_bias={"12": 100}),
        "min_p 0.1, sampled": comp(short, 8, temperature=0.8, min_p=0.1),
        "logprob_token_ids": comp(short, 8, logprobs=1, logprob_token_ids=[260, 30]),
        "seed 1234, sampled": comp(long, 24, temperature=1.0, seed=1234),
        "seed 1234, sampled, again": comp(long, 24, temperature=1.0, seed=1234),
        "chat": chat("Write three sentences about the sea.", max_tokens=64),
        "chat, streamed": chat("Count to ten.", stream=True),
        "streamed, usage included": comp(long, 24, stream=True, stream_options={"include_usage": True}),
        "structured: JSON schema (chat)": chat("Give a city and a year as JSON.", max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "city_year", "schema": {
                "type": "object", "required": ["city", "year"],
                "properties": {"city": {"type": "string"}, "year": {"type": "integer"}}}}}),
        "structured: choice": comp(long + "\nIs this text about the sea? Answer:", 4,
                                   structured_outputs={"choice": ["yes", "no"]}),
        "structured: regex": comp(long + "\nA number:", 8, structured_outputs={"regex": "[0-9]{3}"}),
        "beam search, n 2": comp(long, 12, n=2, use_beam_search=True),
        "sfi budget (flat keys)": comp(long, 48, vllm_xargs={"sfi_selected_tokens": 16, "sfi_recent_window": 16}),
        "sfi draft_reselect rejection": comp(long, 48, vllm_xargs={"sfi_draft_reselect": "rejection"}),
        "sfi reuse_budget 8 with min_gap 4": comp(long, 48, vllm_xargs={
            "sfi_draft_reselect": "reuse_budget", "sfi_reuse_budget": 8, "sfi_min_gap": 4}),
        "sfi policy dense": comp(long, 48, vllm_xargs={"sfi_policy": "dense"}),
        "sfi policy quest": comp(long, 48, vllm_xargs={"sfi_policy": "quest"}),
        "sfi as one JSON string": comp(long, 24, vllm_xargs={"sfi": json.dumps({"selected_tokens": 16})}),
        "bad: sfi not JSON": comp(long, 8, vllm_xargs={"sfi": "{not json"}),
        "bad: unknown key": comp(long, 8, vllm_xargs={"sfi_nope": 1}),
        "bad: string for a count": comp(long, 8, vllm_xargs={"sfi_selected_tokens": "many"}),
        "bad: negative window": comp(long, 8, vllm_xargs={"sfi_recent_window": -5}),
        "bad: huge budget": comp(long, 8, vllm_xargs={"sfi_selected_tokens": 10 ** 9}),
        "bad: list for a count": comp(long, 8, vllm_xargs={"sfi_selected_tokens": [1, 2]}),
        "bad: fraction for a count": comp(long, 8, vllm_xargs={"sfi_selected_tokens": 12.5}),
        "bad: nan": comp(long, 8, vllm_xargs={"sfi_selector_alpha": "nan"}),
        "bad: not a boolean": comp(long, 8, vllm_xargs={"sfi_boundary_trigger": "maybe"}),
        "bad: reuse_budget below min_gap": comp(long, 8, vllm_xargs={"sfi_reuse_budget": 8}),
        "bad: engine-wide field": comp(long, 8, vllm_xargs={"sfi_mode": "lossy"}),
        "prompt too long": comp(long * 20, 8),
        "empty prompt": comp("", 8),
    }


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
        if body.get("stream"):  # server-sent events: join the deltas
            parts = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                           for p in parts for c in p.get("choices", []))
            usage = next((p["usage"] for p in reversed(parts) if p.get("usage")), None)
            return 200, {"choices": [{"text": text}], "chunks": len(parts), "usage": usage}
        return 200, json.loads(raw)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def texts(j: dict) -> list[str | None]:
    return [c.get("text") if "text" in c else (c.get("message") or {}).get("content") for c in j.get("choices", [])]


def leave_mid_stream(base: str, engine: str, model: str, long: str) -> list[dict]:
    """A client that reads 5 chunks of a 1,000-token streamed completion (``ignore_eos``: it cannot
    end early on its own) and closes the connection; two seconds later the count of running
    requests (0: the server aborted it), then a greedy request, whose answer must still be dense's."""
    host, port = base.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": long, "max_tokens": 1000,
                                                        "temperature": 0, "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp, chunks = conn.getresponse(), 0
    for line in resp:
        chunks += line.startswith(b"data: {")
        if chunks >= 5:
            break
    resp.close()
    conn.close()
    time.sleep(2)
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        running = [line.rsplit(" ", 1)[1] for line in r.read().decode().splitlines()
                   if line.startswith("vllm:num_requests_running")]
    status, j = post(base, "/v1/completions", {"model": model, "prompt": long, "max_tokens": 24, "temperature": 0})
    return [{"engine": engine, "case": "a client leaves mid-stream", "status": resp.status, "chunks_read": chunks,
             "requests_running_2s_later": running},
            {"engine": engine, "case": "greedy, after the client left", "status": status,
             "texts": texts(j) if status == 200 else None}]


def battery(base: str, engine: str, model: str, long: str) -> list[dict]:
    rows = []
    for name, (path, body) in cases(model, long).items():
        t0 = time.perf_counter()
        status, j = post(base, path, body)
        row = {"engine": engine, "case": name, "status": status, "seconds": round(time.perf_counter() - t0, 2)}
        if status == 200:
            row["texts"] = texts(j)
            row["completion_tokens"] = (j.get("usage") or {}).get("completion_tokens")
            if body.get("stream_options", {}).get("include_usage"):
                row["usage"] = j.get("usage")  # the stream's last chunk
        else:
            row["error"] = (j.get("error") or {}).get("message", j)
            row["param"] = (j.get("error") or {}).get("param")
        rows.append(row)
        print(json.dumps(row)[:300], flush=True)
    rows += leave_mid_stream(base, engine, model, long)
    # six at once, mixing per-request settings
    mixes = [{}, {"sfi_selected_tokens": 16}, {"sfi_draft_reselect": "rejection"}, {"sfi_policy": "dense"}, {},
             {"sfi_recent_window": 8}]

    def one(i: int) -> tuple[int, dict]:
        body = {"model": model, "prompt": long[i * 50:], "max_tokens": 40, "temperature": 0}
        return post(base, "/v1/completions", {**body, "vllm_xargs": mixes[i]} if mixes[i] else body)

    with cf.ThreadPoolExecutor(len(mixes)) as ex:
        for i, (status, j) in enumerate(ex.map(one, range(len(mixes)))):
            rows.append({"engine": engine, "case": f"concurrent {i} {json.dumps(mixes[i])}", "status": status,
                         "texts": texts(j) if status == 200 else None})
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        rows.append({"engine": engine, "case": "/health after all", "status": r.status})  # no texts: status only
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        metrics = [line for line in r.read().decode().splitlines()
                   if line.startswith(("sfi_", "vllm:spec_decode_num")) and "_bucket" not in line]
    rows.append({"engine": engine, "case": "metrics", "metrics": metrics})
    return rows


def serve(model: str, port: int, extra: list[str], log: str) -> subprocess.Popen:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="sfi-prom-"),
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--max-model-len", "2048", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    for _ in range(400):
        if proc.poll() is not None:
            raise SystemExit(f"the server stopped at start-up; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except (urllib.error.URLError, OSError):
            time.sleep(3)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log}")


def table(rows: list[dict], engines_run: list[str]) -> str:
    dense = {r["case"]: r for r in rows if r["engine"] == "dense"}
    out = ["| request | " + " | ".join(engines_run) + " |", "|---|" + "---|" * len(engines_run)]
    for case, d in dense.items():
        if case == "metrics":
            continue
        cells = []
        for e in engines_run:
            r = next((x for x in rows if x["engine"] == e and x["case"] == case), None)
            if r is None:
                cells.append("-")
            elif e == "dense" or r["status"] != 200 or d["status"] != 200 or "texts" not in r:
                cells.append(str(r["status"]))
            else:
                cell = f"200, {'as dense' if r.get('texts') == d.get('texts') else 'differs'}"
                if r.get("completion_tokens") != d.get("completion_tokens"):
                    cell += f" ({r.get('completion_tokens')} tokens counted against {d.get('completion_tokens')})"
                cells.append(cell)
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines, one per request and engine")
    ap.add_argument("--engines", default="dense,lossless,lossy")
    ap.add_argument("--port", type=int, default=8041)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.texts import long_prompts

    model = str(prepare_model(progress=False))
    long = long_prompts(AutoTokenizer.from_pretrained(model), 1, 600, seed=3)[0]
    names = args.engines.split(",")
    rows: list[dict] = []
    for name in names:
        proc = serve(model, args.port, engines(model)[name], f"{args.out}.{name}.log")
        try:
            rows += battery(f"http://127.0.0.1:{args.port}", name, model, long)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
