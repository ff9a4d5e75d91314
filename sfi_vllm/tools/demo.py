"""``sfi-vllm demo``: the same long-ish prompts through vLLM with dense attention and with SFI on the
embedded SmolLM2-135M-Instruct, outputs side by side, and a verdict per request.

One engine runs three phases (each request's attention is chosen per request, as the quality tools
do): dense attention (the ``dense`` policy: vLLM's own kernel at every step), SFI free-running, and
SFI teacher-forced on dense's tokens (:mod:`sfi_vllm.tools.quality.forcing`). The teacher-forced phase
gives the agreement figure: at each decode step SFI sees exactly dense's history, and the step
agrees when SFI's most likely next token is dense's token. Free-running outputs part at the first
disagreement and then follow different histories, so "identical outputs" says little about
quality; the per-step agreement does.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

# What the demo runs unless told otherwise: a working set of 4 sinks + 128 selected tokens per KV
# head + a 128-token recent window, so that on ~1.2K-token prompts fast steps attend to roughly a
# quarter of the context, and slow steps at sentence ends or every 32 fast steps.
DEMO_SFI = {"sinks": 4, "recent_window": 128, "selected_tokens": 128, "reuse_budget": 32, "min_gap": 8}

# The GPU result the closing line cites: the engine's default selection (the balanced preset, with
# its dense bridge and staggered reuse phases; the boundary trigger off, as the benchmark runs
# without a tokenizer, so a slow step after every 64 fast steps) against dense decode throughput,
# one H200, a Qwen3-4B-shaped model, batch 16 x 16K, two timed runs (e2e-h200-itl.md)
GPU_RESULT = "2.23-2.27x"
GPU_RESULT_FILE = "benchmarks/results/e2e-h200-itl.md"

SLOW_REASONS = {"first_decode": "first step after the prompt", "boundary": "sentence end",
                "reuse_budget": "reuse budget spent", "bridge_end": "end of the bridge"}

# The GPU result the lossless line cites: 8 drafts per verify against dense, one H200, a Qwen3-4B-shaped
# model with random weights and vLLM's synthetic acceptance set to what SmolLM2 drafted with working
# sets of 7% and 1.8% of its context (benchmarks/results/lossless-h200.md, part 11)
LOSSLESS_GPU_RESULT = ("1.30-1.34x dense's decode throughput at 8 requests of 32K tokens and 2.12x at 6 of 128K, "
                       "with 6.9 and 5.9 tokens per verify imposed: what SmolLM2 drafted with working sets of "
                       "those runs' shares of the context, 7% and 1.8%")
LOSSLESS_GPU_RESULT_FILE = "benchmarks/results/lossless-h200.md"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None for identical generations."""
    from sfi_vllm.tools.engine_job import common_prefix_len

    return None if a == b else common_prefix_len(a, b)


def forced_agreement(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(agreeing, total) decode steps of a teacher-forced request: the steps where the model's own
    argmax equals the token it was forced on. Step 0 is predicted from the prefill, which is dense
    attention under every policy, so it is left out."""
    dec = steps[1:]
    return sum(int(s["top1"] == s["forced"]) for s in dec), len(dec)


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
    """Tokens attended against context, and the slow steps with why each fired."""
    reasons = ", ".join(f"{v} {SLOW_REASONS.get(k, k)}" for k, v in sorted(st["slow_reasons"].items())) or "none"
    attended = (f"a fast step read {st['mean_attended_per_fast_step']:.0f} of "
                f"{st['mean_context_per_fast_step']:.0f} context tokens per layer and KV head "
                f"({100 * st['attended_fraction']:.1f}%)" if st["fast_steps"] else
                "no fast steps (every decode step was dense or slow: give more --max-tokens)")
    return (f"  attended: {attended}\n"
            f"  slow steps: {st['slow_steps']} of {st['decode_steps']} decode steps ({reasons}); "
            f"{st['fast_steps']} fast, {st['dense_steps']} dense (the bridge of the first decode steps after the "
            "prompt)")


def gpu_result_link(name: str = GPU_RESULT_FILE) -> str:
    """The results file in this checkout, or where it is when sfi-vllm was installed from a wheel."""
    path = Path(__file__).resolve().parents[2] / name
    return str(path) if path.exists() else f"{name} in sfi-vllm's source repository"


def lossless_line(dense_ids: list[int], lossless: dict[str, Any], stats: dict[str, Any]) -> str:
    """One request's verdict line for ``--lossless``: the output against dense's, and the drafts."""
    div = first_divergence(dense_ids, lossless["token_ids"])
    same = ("dense's tokens, all " + str(len(dense_ids)) if div is None else
            f"parts from dense's at token {div} of {len(dense_ids)} (the verify pass computes several tokens at "
            "once, and its rounding can break a near-tie the other way: docs/lossless.md)")
    if not stats["verify_steps"]:
        return f"  lossless: {same}; no drafts were verified"
    return (f"  lossless: {same}; {stats['acceptance_length']:.2f} tokens per verify "
            f"({stats['accepted_tokens']} of {stats['drafted_tokens']} drafts kept in {stats['verify_steps']} "
            "verify steps)")


def run_lossless(model: str, prompts: list[str], max_tokens: int, sfi_cfg: dict[str, Any],
                 engine: dict[str, Any]) -> dict[str, Any]:
    """The prompts greedily through a second engine, in a process of its own: ``sfi.mode: lossless``
    with the demo's working set drafting (``LOSSLESS_DRAFTS`` per verify, the model as its own
    drafter) and dense attention verifying (docs/lossless.md)."""
    from sfi_vllm.tools.engine_job import LOSSLESS_DRAFTS, EngineJob, cpu_engine_env, run_engine_job

    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": LOSSLESS_DRAFTS}
    job = EngineJob(model=model, prompts=prompts, max_tokens=max_tokens, attention_backend="sfi",
                    sfi={**sfi_cfg, "mode": "lossless"}, engine_kwargs={**engine, "speculative_config": spec})
    try:
        return run_engine_job(job, env=cpu_engine_env())
    except RuntimeError as e:  # its log's tail, without the whole of vLLM's start-up
        raise RuntimeError("the lossless engine of the demo failed; the end of its log:\n"
                           + str(e)[-2000:]) from None


def lossless_summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo's ``--lossless`` totals over ``requests`` (each with ``dense``, ``lossless`` and
    ``lossless_stats``): outputs identical to dense's, verify steps, drafts made and kept, and the
    tokens per verify step (None without a verify step)."""
    stats = [r["lossless_stats"] for r in requests]
    steps = sum(st["verify_steps"] for st in stats)
    kept = sum(st["accepted_tokens"] for st in stats)
    return dict(identical=sum(r["lossless"]["token_ids"] == r["dense"]["token_ids"] for r in requests),
                requests=len(requests), verify_steps=steps, drafted=sum(st["drafted_tokens"] for st in stats),
                accepted=kept, tokens_per_verify=round((kept + steps) / steps, 3) if steps else None)


class DemoLengthError(ValueError):
    """The prompts and answers asked for do not fit the model's context length."""


def run_demo(num_prompts: int = 4, prompt_tokens: int = 1200, max_tokens: int = 96,
             sfi: dict[str, Any] | None = None, seed: int = 0, json_out: str | None = None,
             cache_dir: str | None = None, lossless: bool = False) -> dict[str, Any]:
    from sfi_vllm.tools.batch import Request, engine_env_for_this_process, run_requests
    from sfi_vllm.config import build_config

    sfi_cfg = dict(DEMO_SFI if sfi is None else sfi)
    build_config(sfi_cfg)  # fail early, with the field named, on a bad setting
    if lossless:
        build_config({**sfi_cfg, "mode": "lossless"})  # and on one the lossless mode refuses
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout; keep the demo's output readable
    engine_env_for_this_process()

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from sfi_vllm.tools.engine_job import CPU_DTYPE
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.quality.forcing import FORCE_PROCESSOR, collect
    from sfi_vllm.tools.texts import long_prompts

    say = lambda msg: print(f"[sfi-vllm demo] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say("preparing SmolLM2-135M-Instruct")
    model = str(prepare_model(cache_dir, progress=True))
    from sfi_vllm.tools.quality.runner import engine_max_len

    try:  # the prompts, the chat template's tokens and the answers, within the model's length
        max_model_len = engine_max_len(model, [prompt_tokens + max_tokens + 64])
    except ValueError:
        raise DemoLengthError(f"--prompt-tokens {prompt_tokens} + --max-tokens {max_tokens} (+ 64 for the chat "
                         "template) exceed the model's context length") from None
    tok = AutoTokenizer.from_pretrained(model)
    prompts = long_prompts(tok, num_prompts, prompt_tokens, seed=seed)
    engine = dict(max_model_len=max_model_len, max_num_seqs=max(2, num_prompts),
                  dtype="auto" if torch.cuda.is_available() else CPU_DTYPE)
    ll = None
    if lossless:  # first, in a process of its own, so that the two engines never hold the cores together
        say("running the prompts in sfi.mode lossless, in an engine of its own (about 40-50 s on 2 cores)")
        ll = run_lossless(model, prompts, max_tokens, sfi_cfg, engine)
    say("loading the vLLM engine with the SFI backend (about 30 s on 2 cores)")
    llm = LLM(model=model, attention_backend="sfi", additional_config={"sfi": sfi_cfg},
              logits_processors=[FORCE_PROCESSOR], generation_config="vllm", enforce_eager=True, seed=0,
              **engine)
    chats = [[{"role": "user", "content": p}] for p in prompts]

    def phase(desc: str, params: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}
        reqs = [Request(id=f"{desc}-{i}", params=sp, messages=m) for i, (sp, m) in enumerate(zip(params, chats))]
        totals = run_requests(llm, iter(reqs), lambda r: results.__setitem__(r["id"], r), max_open=len(reqs),
                              desc=desc, total_tokens=sum(sp.max_tokens for sp in params))
        out = [results[r.id] for r in reqs]
        for r in out:
            if r.get("error"):
                raise RuntimeError(f"demo request {r['id']} failed: {r['error']}")
        return out, totals

    greedy = dict(max_tokens=max_tokens, temperature=0.0)
    dense, t_dense = phase("dense", [SamplingParams(**greedy, extra_args={"sfi": {"policy": "dense"}})
                                     for _ in prompts])
    sfi_out, t_sfi = phase("SFI", [SamplingParams(**greedy) for _ in prompts])
    forced, _ = phase("SFI teacher-forced", [
        SamplingParams(max_tokens=len(d["token_ids"]), temperature=0.0, ignore_eos=True,
                       extra_args={"force": {"tokens": d["token_ids"], "tag": f"demo-{i}"}})
        for i, d in enumerate(dense)])
    steps = collect()["tags"]

    import vllm

    width = min(shutil.get_terminal_size((120, 20)).columns, 160)
    report: dict[str, Any] = {"sfi_config": sfi_cfg, "vllm_version": vllm.__version__, "requests": []}
    print(f"\nSFI settings: {json.dumps(sfi_cfg)} (vLLM {vllm.__version__})")
    agree_all = total_all = 0
    attended = []
    for i, (d, s) in enumerate(zip(dense, sfi_out)):
        st = s.get("sfi_stats")
        if st is None:
            raise RuntimeError(f"no SFI statistics for request {s['id']}")
        agree, total = forced_agreement(steps[f"demo-{i}"])
        agree_all, total_all = agree_all + agree, total_all + total
        if st["fast_steps"]:
            attended.append(st["attended_fraction"])
        div = first_divergence(d["token_ids"], s["token_ids"])
        print("\n" + "=" * width)
        print(f"request {i}: {d['prompt_tokens']}-token prompt: {prompts[i][:90]!r}...")
        print(_side_by_side(d["text"], s["text"], width))
        print(f"verdict for request {i}:")
        print(f"  agreement with dense: {100 * agree / max(total, 1):.1f}% teacher-forced top-1 "
              f"({agree} of {total} decode steps); free-running, "
              + ("the outputs are identical" if div is None else
                 f"the outputs agree for the first {div} of {len(s['token_ids'])} tokens"))
        print(format_stats(st))
        entry = dict(prompt_tokens=d["prompt_tokens"], dense=d, sfi=s, stats=st,
                     forced_top1=[agree, total], first_divergence=div)
        if ll is not None:
            lo = ll["outputs"][i]
            lst = ll["sfi_stats"].get(lo["request_id"])
            if lst is None:
                raise RuntimeError(f"no SFI statistics for the lossless engine's request {lo['request_id']}")
            print(lossless_line(d["token_ids"], lo, lst))
            entry.update(lossless=lo, lossless_stats=lst,
                         lossless_first_divergence=first_divergence(d["token_ids"], lo["token_ids"]))
        report["requests"].append(entry)
    print("\n" + "=" * width)
    read = (f"while its fast steps read {100 * sum(attended) / len(attended):.1f}% of the context on average"
            if attended else "with no fast steps (every decode step was dense or slow: give more --max-tokens)")
    print(f"Verdict: SFI chose dense's next token at {100 * agree_all / max(total_all, 1):.1f}% of "
          f"{total_all} teacher-forced decode steps, {read}.")
    print("What this shows: which decode steps SFI re-selects at (slow) and why, how little of the context "
          "the other (fast) steps attend to, and how often the next token still matches dense attention. "
          f"It does not show speed: on the CPU, SFI runs its torch reference path, which is not faster than "
          f"dense (here {t_sfi['seconds']:.1f} s for SFI's tokens against {t_dense['seconds']:.1f} s for "
          "dense's, whose time includes the prompts' prefill that SFI then reused from vLLM's prefix "
          f"cache). Speed is a GPU matter: on an NVIDIA H200 at 16 requests of 16K tokens, SFI's "
          f"default selection, dense bridge included, with a slow step after every 64 fast steps "
          f"(the boundary trigger off: the benchmark runs without a tokenizer), decoded {GPU_RESULT} "
          f"as fast as dense "
          f"attention ({gpu_result_link()}).")
    if ll is not None:
        from sfi_vllm.tools.engine_job import LOSSLESS_DRAFTS

        tot = lossless_summary(report["requests"])
        kept = ("no drafts were verified" if tot["tokens_per_verify"] is None else
                f"{tot['tokens_per_verify']:.2f} tokens per verify step")
        print(f"Lossless: with sfi.mode lossless the same working set drafted {LOSSLESS_DRAFTS} tokens per verify "
              f"and dense attention checked them: {tot['identical']} of {tot['requests']} outputs were dense's "
              f"token for token, at {kept}. On an H200: {LOSSLESS_GPU_RESULT} ({gpu_result_link(LOSSLESS_GPU_RESULT_FILE)}, "
              "part 11; docs/lossless.md).")
        report.update(lossless=tot, lossless_drafts=LOSSLESS_DRAFTS, lossless_sfi_config=ll["sfi_config"],
                      lossless_generate_s=ll["generate_s"])
    report.update(forced_top1=[agree_all, total_all], dense_s=t_dense["seconds"], sfi_s=t_sfi["seconds"])
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"full results: {json_out}")
    return report
