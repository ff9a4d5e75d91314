"""``sfi-vllm fidelity``: teacher-forced long-generation fidelity of each policy against dense.

For every document (a long essay prompt, :func:`sfi_vllm.tools.texts.long_prompts`) one vLLM engine with
the SFI backend runs, in phases:

0. dense, free-running greedy: the dense continuation ``y_0 .. y_T`` (``T + 1`` tokens: ``y_0`` is
   predicted from the prefill, ``y_1 .. y_T`` by ``T`` decode steps);
1. dense again, *teacher-forced* on ``y`` (:mod:`sfi_vllm.tools.quality.forcing`): its raw next-token
   distribution at every step is the reference ``p_dense(. | prompt, y_<s)``;
2. every policy (``dense`` included, as a run-to-run check) at every retention, teacher-forced on
   ``y``: at step ``s`` the policy's own distribution ``p_pol(. | prompt, y_<s)`` is compared with
   the reference; and, unless disabled, every policy free-running (greedy, not forced).

The forced tokens pass through decode steps, so SFI's fast/slow machinery runs on them exactly as
when it generates (prefill, dense for every policy, is the prompt alone).

Metrics over the ``T`` decode steps of every document (step 0 comes from the dense prefill and is
left out):

* ``top1_agreement``: share of steps where the policy's argmax equals the reference's argmax;
* ``kl_mean`` (also ``kl_p50``, ``kl_p90``, ``kl_max``): KL(dense || policy) in nats, over the full
  vocabulary (49,152 for SmolLM2), computed in float64 from the raw logits of both runs;
* ``nll_delta``: mean increase of ``-log p(y_s)`` (the dense token) from dense to the policy;
* ``free_agree_tokens``: free-running decode tokens before the first token that differs from the
  dense continuation (``T`` if none does), mean over documents; ``free_identical`` the share of
  documents with no difference in ``T`` tokens;
* ``measured_retention`` and ``slow_step_rate`` of the forced runs, from the worker's statistics;
* ``top1_fresh`` / ``kl_mean_fresh`` over ``n_fresh_steps``: the same on the steps whose dense token
  does not complete an 8-gram already in the continuation (a small model's greedy text falls into
  loops, which any policy that keeps the recent window predicts; those steps inflate ``top1``).

Checks recorded on every row: ``ref_self_top1`` (the reference's argmax equals the token it was
forced on, i.e. dense free-running and dense forced agree) and ``raw_check_mismatches`` (steps
where the processor's argmax differs from the top-1 token of vLLM's own ``logprobs``, which vLLM
0.27 computes from the raw logits before any logits processor).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from sfi_vllm.tools.policies import policy_overrides
from sfi_vllm.tools.quality.runner import engine_max_len, engine_settings  # noqa: F401 (engine_max_len: part of this module's API)

DEFAULT_POLICIES = ("dense", "sfi", "sfi-paper", "streaming", "snapkv", "quest")
DEFAULT_INSTRUCTION = "Summarize the text above in detail, section by section."
TEMPLATE_ALLOWANCE = 64  # instruction + chat template tokens left out of the document's budget
KL_METHOD = ("KL(dense || policy) in nats over the full vocabulary, float64, from the raw logits "
             "of the teacher-forced dense run and the teacher-forced policy run at the same step; "
             "mean over all decode steps of all documents")
COLLECT = "sfi_vllm.tools.quality.forcing:collect"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def doc_tokens_for(context: int, tokens: int) -> int:
    """Document tokens for a context: prompt + continuation stay within ``context``."""
    n = context - tokens - TEMPLATE_ALLOWANCE
    if n < 64:
        raise ValueError(f"context {context} leaves no room for a document with {tokens} generated tokens")
    return n


def build_requests(prompts: dict[int, list[str]], policies, retentions, tokens: int,
                   free_running: bool = True, ignore_eos: bool = True) -> tuple[list[dict], list[tuple]]:
    """The engine job's requests and a key per request: ``(kind, context, doc, policy, retention)``
    with kind ``free-dense`` (phase 0), ``ref`` (phase 1), ``forced`` or ``free`` (phase 2)."""
    reqs: list[dict] = []
    keys: list[tuple] = []
    free_idx: dict[tuple[int, int], int] = {}
    for ctx, docs in prompts.items():
        for d, p in enumerate(docs):
            free_idx[(ctx, d)] = len(reqs)
            reqs.append(dict(prompt=p, max_tokens=tokens + 1, sfi={"policy": "dense"}, phase=0,
                             ignore_eos=ignore_eos))
            keys.append(("free-dense", ctx, d, "dense", None))
    for ctx, docs in prompts.items():
        for d, p in enumerate(docs):
            reqs.append(dict(prompt=p, sfi={"policy": "dense"}, phase=1, ignore_eos=True, logprobs=1,
                             force_from=free_idx[(ctx, d)],
                             extra_args={"force": {"tag": f"ref/{ctx}/{d}", "save_ref": f"{ctx}/{d}"}}))
            keys.append(("ref", ctx, d, "dense", None))
    for pol in policies:
        for r in ([None] if pol == "dense" else retentions):
            for ctx, docs in prompts.items():
                over = policy_overrides(pol, r, ctx)
                for d, p in enumerate(docs):
                    reqs.append(dict(prompt=p, sfi=over, phase=2, ignore_eos=True, logprobs=1,
                                     force_from=free_idx[(ctx, d)],
                                     extra_args={"force": {"tag": f"{pol}/{r}/{ctx}/{d}", "ref": f"{ctx}/{d}"}}))
                    keys.append(("forced", ctx, d, pol, r))
                    if free_running and pol != "dense":
                        reqs.append(dict(prompt=p, max_tokens=tokens + 1, sfi=over, phase=2, ignore_eos=ignore_eos))
                        keys.append(("free", ctx, d, pol, r))
    return reqs, keys


def raw_check(steps: list[dict], logprobs: list[dict[str, float]] | None) -> int:
    """Steps where the processor's argmax differs from the top-1 token of vLLM's logprobs
    (``logprobs=1``: the forced token and the top-1), ties aside."""
    if logprobs is None:
        return 0
    bad = 0
    for rec, lp in zip(steps, logprobs):
        best = max(lp.values())
        top = {int(t) for t, v in lp.items() if v >= best - 1e-6}
        if rec["top1"] not in top:
            bad += 1
    return bad


def per_request(keys: list[tuple], res: dict[str, Any], tokens: int) -> list[dict[str, Any]]:
    """One record per teacher-forced or free-running request (``--raw``)."""
    from sfi_vllm.tools.engine_job import common_prefix_len

    coll = res["collected"][COLLECT]
    if coll["missing_ref"]:
        raise RuntimeError(f"teacher forcing: {len(coll['missing_ref'])} steps had no dense reference")
    tags = coll["tags"]
    outs = res["outputs"]
    dense_free = {(k[1], k[2]): outs[i]["token_ids"] for i, k in enumerate(keys) if k[0] == "free-dense"}
    recs = []
    for i, (kind, ctx, d, pol, r) in enumerate(keys):
        o = outs[i]
        st = res["sfi_stats"].get(o["request_id"], {})
        rec: dict[str, Any] = dict(kind=kind, policy=pol, retention=r, context=ctx, doc=d,
                                   prompt_tokens=o["prompt_tokens"], config_error=st.get("config_error"),
                                   fallback=st.get("fallback"))
        if kind == "free-dense":
            rec.update(token_ids=o["token_ids"], text=o["text"], finish_reason=o["finish_reason"])
        elif kind == "free":
            y = dense_free[(ctx, d)]
            # decode tokens (after the prefill's token) equal to dense's before the first difference
            rec.update(token_ids=o["token_ids"], text=o["text"], possible_tokens=len(y) - 1,
                       agree_tokens=min(len(y) - 1, max(0, common_prefix_len(y, o["token_ids"]) - 1)))
        else:
            tag = f"ref/{ctx}/{d}" if kind == "ref" else f"{pol}/{r}/{ctx}/{d}"
            steps = tags[tag]
            y = dense_free[(ctx, d)]
            if o["token_ids"] != y:
                raise RuntimeError(f"teacher forcing failed for {tag}: output differs from the forced tokens")
            if len(steps) != len(y):
                raise RuntimeError(f"{tag}: {len(steps)} recorded steps for {len(y)} tokens")
            rec.update(raw_check_mismatches=raw_check(steps, o.get("logprobs")),
                       self_top1=[int(s["top1"] == f) for s, f in zip(steps, y)],
                       fast_steps=st.get("fast_steps", 0), slow_steps=st.get("slow_steps", 0),
                       decode_steps=st.get("decode_steps", 0), attended_fraction=st.get("attended_fraction"))
            if kind == "forced":
                dec = steps[1:]  # step 0 comes from the (dense) prefill
                rec.update(top1=[int(s["top1"] == s["ref_top1"]) for s in dec], kl=[s["kl"] for s in dec],
                           nll_delta=[s["ref_forced_logp"] - s["forced_logp"] for s in dec],
                           prefill_step_kl=steps[0]["kl"])
        recs.append(rec)
    errors = [p for p in recs if p["config_error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} requests had a bad SFI config: {errors[0]['config_error']}")
    fell_back = sum(p["fallback"] == "compact_pool_full" for p in recs)
    if fell_back:
        from sfi_vllm.tools.quality.runner import pool_full_message

        raise RuntimeError(pool_full_message(fell_back, len(recs)))
    return recs


REPEAT_NGRAM = 8


def repeated_steps(ids: list[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """For decode steps 1..len(ids)-1: does token ``ids[s]`` complete an ``n``-gram of ``ids`` that
    already ended at an earlier position?"""
    seen: set[tuple[int, ...]] = set()
    out = []
    for s in range(len(ids)):
        g = tuple(ids[s - n + 1:s + 1]) if s >= n - 1 else None
        if s >= 1:
            out.append(g is not None and g in seen)
        if g is not None:
            seen.add(g)
    return out


# two-sided 95% Student-t quantiles for 1-30 degrees of freedom (neither we nor vLLM depend on
# scipy); beyond 30, t975 uses the Cornish-Fisher expansion around the normal quantile
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table to 30, then the
    Cornish-Fisher series to 1/df^3: within 1e-4 of the exact value from df = 31 on)."""
    if df < 1:
        raise ValueError(f"t975: degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


def doc_half_width(per_doc: list[float]) -> float | None:
    """95% half-width of the mean of per-document values (Student t over documents: the steps of
    one document are correlated, so documents are the sample); None below two documents."""
    n = len(per_doc)
    if n < 2:
        return None
    return t975(n - 1) * statistics.stdev(per_doc) / n ** 0.5


def paired_top1(recs: list[dict[str, Any]], against: str = "sfi") -> list[dict[str, Any]]:
    """``against`` minus every other policy in teacher-forced top-1 agreement, paired by document:
    per context and retention, the mean over documents of the per-document difference and its 95%
    half-width (Student t over documents). Dense (retention 1) is compared at every retention.
    Only documents both policies ran are used."""
    per_doc: dict[tuple, dict[int, float]] = {}
    for p in recs:
        if p["kind"] == "forced":
            per_doc.setdefault((p["policy"], p["retention"], p["context"]), {})[p["doc"]] = statistics.fmean(p["top1"])
    out = []
    for (pol, r, ctx), mine in sorted(per_doc.items(), key=lambda kv: (kv[0][2], kv[0][1] or 0, kv[0][0])):
        if pol != against:
            continue
        for (other, r2, ctx2), theirs in per_doc.items():
            if other == against or ctx2 != ctx or (r2 != r and other != "dense"):
                continue
            docs = sorted(set(mine) & set(theirs))
            d = [mine[i] - theirs[i] for i in docs]
            if not d:
                continue
            out.append(dict(context=ctx, retention=r, policy=other, n_docs=len(d),
                            top1_diff=round(statistics.fmean(d), 4), top1_diff_half_width=_round(doc_half_width(d), 4)))
    return out


def summarize(recs: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """One row per policy x context x retention."""
    refs = {(p["context"], p["doc"]): p for p in recs if p["kind"] == "ref"}
    repeats = {(p["context"], p["doc"]): repeated_steps(p["token_ids"]) for p in recs if p["kind"] == "free-dense"}
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for p in recs:
        if p["kind"] == "forced":
            groups.setdefault((p["policy"], p["context"], p["retention"]), []).append(p)
    free: dict[tuple, list[dict]] = {}
    for p in recs:
        if p["kind"] == "free":
            free.setdefault((p["policy"], p["context"], p["retention"]), []).append(p)
    for (pol, ctx, r), items in groups.items():
        top1 = [x for p in items for x in p["top1"]]
        kl = [x for p in items for x in p["kl"]]
        nll = [x for p in items for x in p["nll_delta"]]
        ref_self = [x for p in items for x in refs[(ctx, p["doc"])]["self_top1"][1:]]
        fr = [p["attended_fraction"] for p in items if p["fast_steps"]]
        dec = sum(p["decode_steps"] for p in items)
        row = dict(policy=pol, context=ctx, retention=1.0 if r is None else r, n_docs=len(items),
                   tokens=tokens, n_steps=len(top1),
                   prompt_tokens=round(statistics.fmean(p["prompt_tokens"] for p in items), 1),
                   top1_agreement=round(statistics.fmean(top1), 4),
                   top1_min_doc=round(min(statistics.fmean(p["top1"]) for p in items), 4),
                   top1_doc_half_width=_round(doc_half_width([statistics.fmean(p["top1"]) for p in items]), 4),
                   kl_mean=round(statistics.fmean(kl), 5), kl_p50=round(_pct(kl, 0.5), 5),
                   kl_p90=round(_pct(kl, 0.9), 5), kl_max=round(max(kl), 4), kl_method=KL_METHOD,
                   nll_delta=round(statistics.fmean(nll), 5),
                   measured_retention=round(statistics.fmean(fr), 4) if fr else 1.0,
                   slow_step_rate=round(sum(p["slow_steps"] for p in items) / dec, 4) if dec else None,
                   ref_self_top1=round(statistics.fmean(ref_self), 4),
                   raw_check_mismatches=sum(p["raw_check_mismatches"] for p in items))
        if all((ctx, p["doc"]) in repeats for p in items):
            fresh = [(t, k) for p in items for t, k, rep in zip(p["top1"], p["kl"], repeats[(ctx, p["doc"])]) if not rep]
            row.update(n_fresh_steps=len(fresh),
                       top1_fresh=round(statistics.fmean(t for t, _ in fresh), 4) if fresh else None,
                       kl_mean_fresh=round(statistics.fmean(k for _, k in fresh), 5) if fresh else None)
        fitems = free.get((pol, ctx, r))
        if fitems:
            row.update(free_agree_tokens=round(statistics.fmean(p["agree_tokens"] for p in fitems), 1),
                       free_identical=round(statistics.fmean(p["agree_tokens"] >= p["possible_tokens"]
                                                           for p in fitems), 3))
        elif pol == "dense":
            row.update(free_agree_tokens=float(tokens), free_identical=1.0)
        rows.append(row)
    order = {p: i for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows))}
    return sorted(rows, key=lambda r: (r["context"], r["retention"] if r["policy"] != "dense" else 0, order[r["policy"]]))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_fidelity(policies=DEFAULT_POLICIES, retentions=(0.1, 0.2), contexts=(2048,), docs: int = 3,
                 tokens: int = 128, seed: int = 0, out: str = "fidelity.jsonl", raw_out: str | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, free_running: bool = True, ignore_eos: bool = True,
                 kv_cache_gib: int = 4, max_num_seqs: int = 8, engine_kwargs: dict | None = None,
                 model: str | None = None, progress: bool = True, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, cpu_engine_env, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.quality.forcing import FORCE_PROCESSOR
    from sfi_vllm.tools.texts import long_prompts

    from sfi_vllm.tools.quality.runner import check_model_dir, resolve_dtype

    model = check_model_dir(model) if model else str(prepare_model(progress=False))
    dtype = resolve_dtype(dtype)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = {ctx: long_prompts(tok, docs, doc_tokens_for(ctx, tokens), seed=seed, instruction=instruction)
               for ctx in contexts}
    policies = list(policies)
    if "dense" not in policies:
        policies.insert(0, "dense")
    reqs, keys = build_requests(prompts, policies, retentions, tokens, free_running, ignore_eos)
    print(f"fidelity: {len(reqs)} requests ({docs} documents x {len(contexts)} contexts, T={tokens}) "
          f"in one vLLM engine", flush=True)
    max_len, sfi, user = engine_settings(model, engine_kwargs, policies, retentions, contexts)
    eng = dict(max_model_len=max_len, max_num_seqs=max_num_seqs, enable_prefix_caching=True,
               dtype=dtype, logits_processors=[FORCE_PROCESSOR])
    if gpu_memory_utilization is not None:
        eng["gpu_memory_utilization"] = gpu_memory_utilization
    eng.update(user)
    t0 = time.time()
    res = run_engine_job(EngineJob(model=model, requests=reqs, attention_backend="sfi", sfi=sfi,
                                   require_compact_sets=True,
                                   engine_kwargs=eng, progress=progress, collect=[COLLECT]),
                         env={} if _cuda() else cpu_engine_env(kv_cache_gib), quiet=not progress)
    print(f"engine finished in {time.time() - t0:.0f} s (generate {res['generate_s']:.0f} s)", flush=True)
    recs = per_request(keys, res, tokens)
    for p in recs:
        p["vllm_version"] = res["vllm_version"]
    if raw_out:
        with open(raw_out, "w") as f:
            for p in recs:
                f.write(json.dumps(p) + "\n")
    return _write_rows(recs, tokens, out)


def _write_rows(recs: list[dict[str, Any]], tokens: int, out: str) -> list[dict[str, Any]]:
    rows = summarize(recs, tokens)
    version = next((p["vllm_version"] for p in recs if p.get("vllm_version")), None)
    for row in rows:
        row["vllm_version"] = version
    bad = sum(r["raw_check_mismatches"] for r in rows)
    if bad:
        print(f"WARNING: {bad} steps where the recorded argmax differs from vLLM's raw logprobs", flush=True)
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {out}", flush=True)
    return rows


def load_raw(raw: str) -> list[dict[str, Any]]:
    """The records of a ``--raw`` file (``.xz``-compressed or plain JSON lines)."""
    import lzma

    with (lzma.open(raw, "rt") if raw.endswith(".xz") else open(raw)) as f:
        return [json.loads(line) for line in f if line.strip()]


def rows_from_raw(raw: str, out: str, vllm_version: str | None = None) -> list[dict[str, Any]]:
    """Summarize a ``--raw`` file again (no engine): the rows ``run_fidelity`` writes."""
    recs = load_raw(raw)
    for p in recs:
        p.setdefault("vllm_version", vllm_version)
    forced = [p for p in recs if p["kind"] == "forced"]
    if not forced:
        raise ValueError("it holds no teacher-forced records (kind 'forced')")
    tokens = max(len(p["top1"]) for p in forced)
    return _write_rows(recs, tokens, out)


def markdown(rows: list[dict[str, Any]], title: str = "Teacher-forced fidelity", command: str | None = None,
             paired: list[dict[str, Any]] | None = None, against: str = "sfi") -> str:
    lines = [f"# {title}", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += ["`top1`: share of decode steps where the policy's argmax equals dense's (teacher-forced on",
              "dense's greedy continuation). `KL`: " + KL_METHOD + ".",
              "`nll+`: mean increase of the dense token's negative log-likelihood. `free agree`: free-running",
              "decode tokens before the first difference from dense (mean over documents).",
              "`top1` carries the 95% half-width over documents (Student t on the per-document means: a",
              "document's steps are correlated, so the documents are the sample).", "",
              "`top1 fresh` / `KL fresh`: only the steps whose dense token does not complete an 8-gram already",
              "in the continuation (repetition loops excluded).", "",
              "| context | retention | policy | top1 | KL mean | KL p50 | KL p90 | top1 fresh | KL fresh | nll+ | measured | slow-step rate | free agree | docs x steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fresh = (f"{100 * r['top1_fresh']:.1f}% ({r['n_fresh_steps']}) | {r['kl_mean_fresh']:.4f}"
                 if r.get("top1_fresh") is not None else "- | -")
        hw = r.get("top1_doc_half_width")
        top1 = f"{100 * r['top1_agreement']:.1f}%" + (f" ± {100 * hw:.1f}" if hw is not None else "")
        lines.append(f"| {r['context']} | {r['retention']:.2f} | {r['policy']} | {top1} | "
                     f"{r['kl_mean']:.4f} | {r['kl_p50']:.4f} | {r['kl_p90']:.4f} | {fresh} | {r['nll_delta']:.4f} | "
                     f"{r['measured_retention']} | {r['slow_step_rate']} | {r.get('free_agree_tokens', '-')} | "
                     f"{r['n_docs']} x {r['tokens']} |")
    if paired:
        lines += ["", f"`{against}` minus each policy in top-1 agreement, paired by document (points, ± 95% "
                  f"half-width over documents; negative: `{against}` agrees less with dense). Dense is compared "
                  "at every retention.", "",
                  "| context | retention | policy | difference | documents |", "|---|---|---|---|---|"]
        for r in paired:
            hw = r["top1_diff_half_width"]
            lines.append(f"| {r['context']} | {r['retention']:.2f} | {r['policy']} | {100 * r['top1_diff']:+.1f}"
                         + (f" ± {100 * hw:.1f}" if hw is not None else "") + f" | {r['n_docs']} |")
    return "\n".join(lines) + "\n"
