"""``sfi-vllm demo``: the same long-ish prompts through vLLM with dense attention and with SFI on the
embedded SmolLM2-135M-Instruct, outputs side by side, and SFI's statistics per request."""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Any

from tqdm import tqdm

# What the demo runs unless told otherwise: a working set of 4 sinks + 128 selected tokens per KV
# head + a 128-token recent window, so that on ~1.2K-token prompts fast steps attend to roughly a
# quarter of the context, and slow steps at sentence ends or every 32 fast steps.
DEMO_SFI = {"sinks": 4, "recent_window": 128, "selected_tokens": 128, "reuse_budget": 32, "min_gap": 8}


def _engine_kwargs(max_model_len: int, num_prompts: int) -> dict[str, Any]:
    from sfi_vllm.engine_job import CPU_DTYPE

    return dict(max_model_len=max_model_len, max_num_seqs=max(2, num_prompts), dtype=CPU_DTYPE)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None for identical generations."""
    from sfi_vllm.engine_job import common_prefix_len

    return None if a == b else common_prefix_len(a, b)


def _side_by_side(left: str, right: str, width: int) -> str:
    col = max(20, (width - 3) // 2)
    la = textwrap.wrap(left.replace("\n", " ⏎ "), col) or [""]
    ra = textwrap.wrap(right.replace("\n", " ⏎ "), col) or [""]
    n = max(len(la), len(ra))
    la += [""] * (n - len(la))
    ra += [""] * (n - len(ra))
    lines = [f"{'dense'.ljust(col)} | SFI", f"{'-' * col}-+-{'-' * col}"]
    lines += [f"{x.ljust(col)} | {y}" for x, y in zip(la, ra)]
    return "\n".join(lines)


def format_stats(st: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(st["slow_reasons"].items())) or "none"
    return (
        f"decode steps {st['decode_steps']}: fast {st['fast_steps']}, slow {st['slow_steps']} "
        f"({reasons}), dense {st['dense_steps']}\n"
        f"fast steps attended {st['mean_attended_per_fast_step']:.0f} tokens per layer on average, "
        f"of a {st['mean_context_per_fast_step']:.0f}-token context "
        f"({100 * st['attended_fraction']:.1f}%)"
    )


def run_demo(num_prompts: int = 4, prompt_tokens: int = 1200, max_tokens: int = 96,
             sfi: dict[str, Any] | None = None, seed: int = 0, json_out: str | None = None,
             cache_dir: str | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from sfi_vllm.config import build_config
    from sfi_vllm.engine_job import EngineJob, cpu_engine_env, run_engine_job
    from sfi_vllm.model_prep import prepare_model
    from sfi_vllm.texts import long_prompts

    sfi_cfg = dict(DEMO_SFI if sfi is None else sfi)
    build_config(sfi_cfg)  # fail early, with the field named, on a bad setting
    width = min(shutil.get_terminal_size((120, 20)).columns, 160)
    bar = tqdm(total=3, desc="sfi-vllm demo", unit="phase",
               bar_format="{desc}: {n_fmt}/{total_fmt} phases |{bar}| {elapsed}{postfix}")
    bar.set_postfix_str("preparing SmolLM2-135M-Instruct")
    model = str(prepare_model(cache_dir, progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = long_prompts(tok, num_prompts, prompt_tokens, seed=seed)
    bar.update(1)
    env = cpu_engine_env(kv_cache_gib=2)
    common = dict(model=model, prompts=prompts, max_tokens=max_tokens,
                  engine_kwargs=_engine_kwargs(prompt_tokens + max_tokens + 512, num_prompts))
    bar.set_postfix_str(f"dense attention: {num_prompts} prompts x ~{prompt_tokens} tokens")
    dense = run_engine_job(EngineJob(**common), env=env)
    bar.update(1)
    bar.set_postfix_str("SFI")
    sfi_res = run_engine_job(EngineJob(**common, attention_backend="sfi", sfi=sfi_cfg), env=env)
    bar.update(1)
    bar.set_postfix_str("done")
    bar.close()

    report: dict[str, Any] = {"sfi_config": sfi_res["sfi_config"], "requests": [],
                              "vllm_version": sfi_res["vllm_version"]}
    print()
    print(f"SFI settings: {json.dumps(sfi_cfg)}")
    print(f"vLLM {sfi_res['vllm_version']}; generate time for {num_prompts} prompts: dense "
          f"{dense['generate_s']:.1f} s, SFI {sfi_res['generate_s']:.1f} s (CPU reference path: "
          "SFI is not faster here; it shows what SFI computes, not its speed)")
    same = 0
    for i, (d, s) in enumerate(zip(dense["outputs"], sfi_res["outputs"])):
        st = sfi_res["sfi_stats"].get(s["request_id"])
        div = first_divergence(d["token_ids"], s["token_ids"])
        same += div is None
        print("\n" + "=" * width)
        print(f"request {i}: {d['prompt_tokens']}-token prompt: {prompts[i][:90]!r}...")
        print(_side_by_side(d["text"], s["text"], width))
        print("identical tokens" if div is None else
              f"outputs agree for the first {div} of {len(s['token_ids'])} tokens")
        if st is None:
            raise RuntimeError(f"no SFI statistics for request {s['request_id']}")
        print(format_stats(st))
        events = ", ".join(f"step {e[0]}: {e[2]}" for e in st["slow_events"][:12])
        more = " ..." if len(st["slow_events"]) > 12 else ""
        print(f"slow steps: {events}{more}")
        report["requests"].append(dict(prompt_tokens=d["prompt_tokens"], dense=d, sfi=s, stats=st,
                                       first_divergence=div))
    print("\n" + "=" * width)
    print(f"{same}/{len(prompts)} requests produced identical greedy outputs with SFI and dense attention")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"full results: {json_out}")
    return report
