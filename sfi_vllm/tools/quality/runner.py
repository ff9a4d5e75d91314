"""``sfi-vllm eval``: the offline suite through real vLLM, every policy in one engine.

All requests run in one engine with the SFI backend; each request carries its policy in
``SamplingParams.extra_args["sfi"]``. Dense requests run first, so the other policies'
prompts hit vLLM's prefix cache and each prompt is prefilled once: prefill is dense for every
policy, so the cached KV is exactly what each policy would have computed.

Long runs (``chunk_samples``): the samples are taken in chunks, ordered by sample index, then
context, then task (so every chunk covers every task), each chunk a dense phase followed by the
phase of every other policy on the same prompts. With ``time_limit_s`` the engine starts no chunk
that would end past the limit, and only samples whose every request ran are scored (each policy is
scored on the same samples). Every finished phase is appended to a stream file, so a run that is
killed or crashes is still scored on its finished chunks. ``ablations`` with ``ablation_samples``
M run those policies on samples of index < M only (fewer samples for secondary policies).

Flow (``flow``, :mod:`sfi_vllm.tools.request_flow`): instead of phases, every sample's other requests
wait for its dense request only (and take its prompt tokens: each prompt is rendered and tokenized
once), and at most ``max_open`` samples are open at a time, so the batch stays full (no phase ends
with a few long requests running alone) and prompts stay cached. With
``time_limit_s`` no sample is opened that is projected to end past the limit, and requests still
running at the limit are aborted; only samples whose every request finished are scored. Samples
open in chunk order, so a cut-off run covers every task and context equally (to within one
sample each). ``first_sample`` skips samples of lower index (a second run that extends a first).

Writes JSON lines, one object per policy x task x context x retention:
``policy, task, context, retention, score, n`` plus ``ci95`` (half-width, normal approximation),
``measured_retention`` (tokens attended per fast step / context, from the worker's statistics),
``slow_step_rate`` and ``agree_tokens`` (greedy tokens before the first divergence from dense on
the same sample).
"""

from __future__ import annotations

import json
import lzma
import math
import os
import stat
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sfi_vllm.tools.policies import POLICIES, policy_overrides


def resolve_dtype(dtype: str | None) -> str:
    """``auto``/None: bfloat16 on CUDA (the checkpoint's dtype), float32 on CPU (see
    :data:`sfi_vllm.tools.engine_job.CPU_DTYPE`); anything else is passed to vLLM as given."""
    from sfi_vllm.tools.engine_job import CPU_DTYPE

    if dtype and dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else CPU_DTYPE


def check_model_dir(path: str | os.PathLike) -> str:
    """An already prepared (converted) model directory: must exist and hold config.json."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"--model {path}: no such directory (give a converted model directory, "
                         f"e.g. the one `sfi-vllm prepare-model` prints)")
    if not (p / "config.json").is_file():
        raise ValueError(f"--model {path}: no config.json in it; not a prepared model directory "
                         f"(`sfi-vllm prepare-model` prints one)")
    return str(p.resolve())


def _open(path: str | os.PathLike, mode: str):
    return lzma.open(path, mode + "t") if str(path).endswith(".xz") else open(path, mode)


def save_suite(samples, path: str | os.PathLike) -> None:
    """Samples as JSON lines (``.xz``: compressed); read back with :func:`load_suite`."""
    with _open(path, "w") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")


class SuiteFileError(ValueError):
    """An ``--suite`` file that is not a suite, or lacks samples the run asks for: found before
    any engine starts."""


def load_suite(path: str | os.PathLike, tasks=None, contexts=None, n: int | None = None):
    """Samples from a :func:`save_suite` file: those of ``tasks`` and ``contexts`` (None: all)
    with index < ``n`` (None: all)."""
    from sfi_vllm.tools.quality.tasks import Sample

    out = []
    with _open(path, "r") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            d["answers"] = tuple(d["answers"])
            s = Sample(**d)
            if (tasks is None or s.task in tasks) and (contexts is None or s.context_tokens in contexts) \
                    and (n is None or s.index < n):
                out.append(s)
    return out


def chunk_order(samples, tasks, contexts) -> list[int]:
    """Indices of ``samples`` by sample index, then context, then task."""
    t_ord = {t: i for i, t in enumerate(tasks)}
    c_ord = {c: i for i, c in enumerate(contexts)}
    return sorted(range(len(samples)), key=lambda i: (samples[i].index, c_ord.get(samples[i].context_tokens, 0),
                                                        t_ord.get(samples[i].task, 0)))


def policy_retentions(policies, retentions) -> list[tuple[str, list[float]]]:
    """``(policy, its retentions)`` for entries ``name`` (every retention of ``retentions``) or
    ``name@r1/r2`` (those retentions only); retention 0 is the engine's own working set."""
    out = []
    for spec in policies:
        name, _, own = spec.partition("@")
        out.append((name, [float(x) for x in own.split("/")] if own else list(retentions)))
    return out


def build_requests(samples, policies, retentions, order: list[int], chunk_samples: int | None = None,
                   ablations=(), ablation_samples: int | None = None):
    """Requests (for :class:`sfi_vllm.tools.engine_job.EngineJob`) and their keys ``(sample, policy,
    retention)``: per chunk of ``order``, a dense phase, then every other policy's phase."""
    plan = policy_retentions(list(policies) + list(ablations), retentions)
    ablations = {name for name, _ in policy_retentions(ablations, retentions)}
    chunk = chunk_samples or max(1, len(order))
    requests, keys = [], []
    for c0 in range(0, len(order), chunk):
        part = order[c0:c0 + chunk]
        phase = 2 * (c0 // chunk)
        for si in part:
            smp = samples[si]
            requests.append(dict(prompt=smp.prompt, max_tokens=smp.max_new_tokens, sfi={"policy": "dense"},
                                 phase=phase))
            keys.append((si, "dense", None))
        for pol, rets in plan:
            if pol == "dense":
                continue
            for r in rets:
                for si in part:
                    smp = samples[si]
                    if pol in ablations and ablation_samples is not None and smp.index >= ablation_samples:
                        continue
                    requests.append(dict(prompt=smp.prompt, max_tokens=smp.max_new_tokens,
                                         sfi=policy_overrides(pol, r, smp.context_tokens), phase=phase + 1))
                    keys.append((si, pol, r))
    return requests, keys


def build_flow_requests(samples, policies, retentions, order: list[int], ablations=(),
                        ablation_samples: int | None = None):
    """As :func:`build_requests`, for a flow (``EngineJob.max_open``): per sample of ``order``, its
    dense request, then every other policy's request on it, each waiting for the dense one
    (``"after"``), so its prompt is in the prefix cache when it starts (and taking the dense
    request's prompt tokens, so only the dense request carries the prompt text)."""
    plan = policy_retentions(list(policies) + list(ablations), retentions)
    ablations = {name for name, _ in policy_retentions(ablations, retentions)}
    requests, keys = [], []
    for si in order:
        smp = samples[si]
        root = len(requests)
        requests.append(dict(prompt=smp.prompt, max_tokens=smp.max_new_tokens, sfi={"policy": "dense"}))
        keys.append((si, "dense", None))
        for pol, rets in plan:
            if pol == "dense" or (pol in ablations and ablation_samples is not None and smp.index >= ablation_samples):
                continue
            for r in rets:
                requests.append(dict(max_tokens=smp.max_new_tokens, sfi=policy_overrides(pol, r, smp.context_tokens),
                                     after=root))
                keys.append((si, pol, r))
    return requests, keys


def prefix_cache_summary(keys, res) -> str | None:
    """How much of the non-dense requests' prompts came from the prefix cache (vLLM's
    ``num_cached_tokens``); None if the outputs do not say."""
    got = [(o["cached_tokens"], o["prompt_tokens"]) for (_, pol, _), o in zip(keys, res["outputs"])
           if pol != "dense" and o is not None and o.get("cached_tokens") is not None]
    if not got:
        return None
    cached, prompt = sum(c for c, _ in got), sum(p for _, p in got)
    return (f"prefix cache: {len(got)} non-dense requests, {100 * cached / max(prompt, 1):.1f}% of their prompt "
            f"tokens cached (vLLM caches whole KV blocks only), {(prompt - cached) / len(got):.1f} tokens each "
            f"left to prefill on average")


def per_request(samples, keys, res) -> tuple[list[dict], int]:
    """Per-request records for the samples whose every request has an output; and how many
    samples were dropped for missing outputs."""
    from sfi_vllm.tools.engine_job import common_prefix_len
    from sfi_vllm.tools.quality.tasks import score

    outs = res["outputs"]
    missing = {si for i, (si, _, _) in enumerate(keys) if outs[i] is None}
    dense_tokens = {si: outs[i]["token_ids"] for i, (si, pol, _) in enumerate(keys)
                    if pol == "dense" and outs[i] is not None}
    per = []
    for i, (si, pol, r) in enumerate(keys):
        if si in missing:
            continue
        smp, o = samples[si], outs[i]
        st = res["sfi_stats"].get(o["request_id"], {})
        per.append(dict(policy=pol, retention=r, task=smp.task, kind=smp.kind, context=smp.context_tokens,
                        index=smp.index, score=score(smp, o["text"]), output=o["text"],
                        answers=list(smp.answers), agree_tokens=common_prefix_len(dense_tokens[si], o["token_ids"]),
                        out_tokens=len(o["token_ids"]), prompt_tokens=o.get("prompt_tokens"),
                        cached_tokens=o.get("cached_tokens"),
                        attended_fraction=st.get("attended_fraction"),
                        decode_attended_fraction=st.get("decode_attended_fraction"),
                        fast_steps=st.get("fast_steps", 0), slow_steps=st.get("slow_steps", 0),
                        slow_reasons=st.get("slow_reasons", {}), dense_steps=st.get("dense_steps", 0),
                        decode_steps=st.get("decode_steps", 0), config_error=st.get("config_error"),
                        fallback=st.get("fallback")))
    return per, len(missing)


def pool_full_message(fell_back: int, total: int) -> str:
    """Why a quality run's numbers cannot stand when ``fell_back`` of its ``total`` requests ran
    densely for a full compact-set pool (their scores would be dense's, credited to the policy)."""
    return (f"{fell_back} of {total} requests ran with dense attention because every compact set was taken "
            "(the GPU's compact-set pool, sfi.compact_memory_gib, held fewer sets than requests ran at once): "
            "their scores would be dense's. Give the pool a set for each of --max-num-seqs requests "
            "(--engine-kwargs '{\"additional_config\": {\"sfi\": {\"compact_memory_gib\": GIB}}}'; the "
            "engine's start-up log gives the size of one set) or lower --max-num-seqs")


def without_pool_fallbacks(per: list[dict]) -> tuple[list[dict], int]:
    """``per`` without the samples of which a request ran densely for a full compact-set pool
    (scored, the sample would credit dense's answer to the policy), and how many requests did."""
    fell = [p for p in per if p.get("fallback") == "compact_pool_full"]
    bad = {(p["task"], p["context"], p["index"]) for p in fell}
    return [p for p in per if (p["task"], p["context"], p["index"]) not in bad], len(fell)


def aggregate(per: list[dict]) -> list[dict[str, Any]]:
    """One row per policy x task x context x retention from per-request records."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in per:
        groups[(p["policy"], p["task"], p["context"], p["retention"])].append(p)
    rows = []
    for (pol, task, ctx, r), items in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] or 1)):
        scores = [100 * p["score"] for p in items]
        fr = [p["attended_fraction"] for p in items if p["fast_steps"] and p["attended_fraction"] is not None]
        dec = sum(p["decode_steps"] for p in items)
        rows.append(dict(
            policy=pol, task=task, kind=items[0]["kind"], context=ctx, retention=1.0 if r is None else r,
            score=round(statistics.fmean(scores), 2), n=len(items),
            ci95=round(1.96 * statistics.stdev(scores) / math.sqrt(len(scores)), 2) if len(scores) > 1 else None,
            measured_retention=round(statistics.fmean(fr), 4) if fr else 1.0,
            slow_step_rate=round(sum(p["slow_steps"] for p in items) / dec, 4) if dec else None,
            agree_tokens=round(statistics.fmean(p["agree_tokens"] for p in items), 1)))
    return rows


def write_jsonl(path: str | os.PathLike, records: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def rescore(raw_files, out: str, merged_raw: str | None = None) -> list[dict[str, Any]]:
    """Rows (as ``eval --out``) from the per-request records of one or more ``eval --raw`` files.
    A request (policy, retention, task, context, sample index) found in more than one file counts
    once, as first found (a warning says how many such requests scored differently)."""
    seen: dict[tuple, dict] = {}
    differ = 0
    for path in raw_files:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                p = json.loads(line)
                key = (p["policy"], p["retention"], p["task"], p["context"], p["index"])
                if key in seen:
                    differ += seen[key]["score"] != p["score"]
                    continue
                seen[key] = p
    if differ:
        print(f"rescore: {differ} requests found twice with different scores; the first file's kept", flush=True)
    per = list(seen.values())
    if merged_raw:
        write_jsonl(merged_raw, per)
    rows = aggregate(per)
    write_jsonl(out, rows)
    return rows


def engine_max_len(model_dir: str, contexts) -> int:
    """``max_model_len`` for a quality engine (eval, fidelity): the largest context plus a margin for the chat
    template's own tokens, never past the model's ``max_position_embeddings`` (vLLM refuses a
    longer one); a context longer than the model's is refused before the engine starts."""
    need = max(contexts)
    cfg_path = os.path.join(model_dir, "config.json")
    limit = None
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            limit = json.load(f).get("max_position_embeddings")
    if limit is None:
        return need + 512
    if need > int(limit):
        raise ValueError(f"context {need} is longer than the model's max_position_embeddings ({limit})")
    return min(need + 512, int(limit))


def engine_sfi(policies, retentions, contexts, max_model_len: int, given: dict | None = None) -> dict:
    """The engine's SFI settings for the requests of ``policies`` (entries as
    :func:`policy_retentions` reads them) x ``retentions`` x ``contexts``: ``given`` (the caller's,
    e.g. from ``--engine-kwargs``' ``additional_config``; ``$SFI_CONFIG`` applies under it, as in
    the engine) as it is where its compact buffers hold every request's sinks + K, merged over it
    as the engine merges them. Where they do not and the caller set no budget, K is raised to fit
    (requests that take the engine's own working set, retention 0, then take that K too).
    Raises ValueError before any engine starts where the caller's budget is too small."""
    from sfi_vllm.config import SFIConfigError, build_config, merge_policy

    given = dict(given or {})
    base = build_config(given)
    need, worst = 0, None
    for policy, own in policy_retentions(policies, retentions):
        if policy == "dense":
            continue
        for r in own:
            for c in contexts:
                cap = merge_policy(base, policy_overrides(policy, r, c)).compact_capacity(max_model_len)
                if cap > need:
                    need, worst = cap, (policy, r, c)
    have = base.compact_capacity(max_model_len)
    if need <= have:
        return given
    policy, r, c = worst
    too_small = (f"policy {policy} at retention {r} and context {c} needs sinks + K = {need} tokens, more than "
                 f"the engine's SFI settings hold ({have})")
    if any(k in given for k in ("selected_tokens", "selected_fraction", "selected_cap")):
        raise ValueError(f"{too_small}; raise the budget of the SFI settings given, or leave it out")
    sfi = {**given, "selected_tokens": need - base.sinks}
    try:
        build_config(sfi)
    except SFIConfigError as e:  # e.g. $SFI_CONFIG gives the budget as a fraction
        raise ValueError(f"{too_small}, and K cannot be raised over them: {e}") from None
    return sfi


def engine_settings(model: str, engine_kwargs: dict | None, policies, retentions,
                    contexts) -> tuple[int, dict, dict]:
    """``(max_model_len, the engine's SFI settings, the other engine kwargs)`` for a quality run:
    the caller's ``max_model_len`` if ``engine_kwargs`` has one, else :func:`engine_max_len`, and
    :func:`engine_sfi`, with the SFI settings a caller gave in
    ``engine_kwargs['additional_config']['sfi']`` taken as ``given``."""
    rest = dict(engine_kwargs or {})
    max_len = rest.get("max_model_len") or engine_max_len(model, contexts)
    extra = dict(rest.pop("additional_config", None) or {})
    sfi = engine_sfi(policies, retentions, contexts, max_len, extra.pop("sfi", None))
    if extra:
        rest["additional_config"] = extra
    return max_len, sfi, rest


def _file_state(path: str) -> tuple[int, int] | None:
    """(size, modification time in ns) of ``path`` if it is a regular file, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def run_eval(policies=POLICIES, retentions=(0.1, 0.2), contexts=(2048,), tasks=None, n=2, seed=0,
             out="quality.jsonl", raw_out: str | None = None, kv_cache_gib: int = 4,
             max_num_seqs: int = 8, engine_kwargs: dict | None = None, model: str | None = None,
             dtype: str | None = None, gpu_memory_utilization: float | None = None,
             suite: str | None = None, chunk_samples: int | None = None,
             time_limit_s: float | None = None, stream_out: str | None = None,
             ablations=(), ablation_samples: int | None = None, progress: bool = True,
             flow: bool = False, max_open: int | None = None, first_sample: int = 0) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sfi_vllm.startup_errors import EngineOptionsRefused
    from sfi_vllm.tools.engine_job import EngineJob, cpu_engine_env, load_stream, run_engine_job
    from sfi_vllm.tools.quality.tasks import TASKS, make_suite

    tasks = tuple(tasks or TASKS)
    if model is None:
        from sfi_vllm.tools.model_prep import prepare_model

        model = str(prepare_model(progress=False))
    else:
        model = check_model_dir(model)
    dtype = resolve_dtype(dtype)
    # the engine's length and SFI settings, checked before the suite is built or an engine starts
    max_len, sfi, eng = engine_settings(model, engine_kwargs, list(policies) + list(ablations), retentions, contexts)
    t0 = time.time()
    if suite:
        samples = []
        for f in suite.split(","):
            try:
                samples += load_suite(f, tasks=set(tasks), contexts=set(contexts), n=n)
            except (KeyError, TypeError, ValueError, lzma.LZMAError, EOFError) as e:  # not what save_suite writes
                raise SuiteFileError(f"--suite {f}: not a file of `sfi-vllm suite` ({type(e).__name__}: {e})") from e
        have = {(s.task, s.context_tokens) for s in samples}
        lacking = [(t, c) for t in tasks for c in contexts if (t, c) not in have]
        if lacking:
            raise SuiteFileError(f"--suite {suite} has no samples for {lacking}")
        src = f"loaded from {suite}"
    else:
        tok = AutoTokenizer.from_pretrained(model)
        samples = make_suite(tok, tasks=tasks, contexts=tuple(contexts), n=n, seed=seed)
        src = "generated"
    samples = [x for x in samples if x.index >= first_sample]
    print(f"suite: {len(samples)} samples ({len(tasks)} tasks x {len(contexts)} contexts x <= {n}), {src}, "
          f"in {time.time() - t0:.1f} s", flush=True)
    order = chunk_order(samples, tasks, contexts)
    if flow:
        max_open = max_open or max(1, max_num_seqs // 2)
        requests, keys = build_flow_requests(samples, policies, retentions, order, ablations, ablation_samples)
        how = f"as a flow, at most {max_open} samples open"
    else:
        requests, keys = build_requests(samples, policies, retentions, order, chunk_samples, ablations,
                                        ablation_samples)
        how = f"chunks of {chunk_samples or len(samples)} samples"
    print(f"running {len(requests)} requests in one vLLM engine ({len(samples)} prefills, {how}, dtype {dtype})",
          flush=True)
    user, eng = eng, dict(max_model_len=max_len, max_num_seqs=max_num_seqs, enable_prefix_caching=True, dtype=dtype)
    if gpu_memory_utilization is not None:
        eng["gpu_memory_utilization"] = gpu_memory_utilization
    eng.update(user)  # the caller's engine kwargs win
    import torch

    env = {} if torch.cuda.is_available() else cpu_engine_env(kv_cache_gib)
    with tempfile.TemporaryDirectory(prefix="sfi-eval-") as tmp:
        stream = stream_out or str(Path(tmp) / "stream.jsonl")
        before = _file_state(stream)  # the engine job empties the stream once its engine has loaded
        t0 = time.time()
        job = EngineJob(model=model, requests=requests, attention_backend="sfi", sfi=sfi, engine_kwargs=eng,
                        require_compact_sets=True,
                        progress=progress, phase_group=2, time_limit_s=time_limit_s, stream_out=stream,
                        max_open=max_open if flow else None)
        failure = None
        try:
            res = run_engine_job(job, env=env, quiet=False)
            print(f"engine finished in {time.time() - t0:.0f} s (load {res['load_s']:.0f} s, "
                  f"generate {res['generate_s']:.0f} s; {res['skipped']} requests skipped by the time limit)",
                  flush=True)
        except EngineOptionsRefused:  # no engine ran: nothing to salvage
            raise
        except Exception as e:  # salvage the finished phases, then fail the run
            failure = e
            # only a regular file this run wrote: an untouched one is an earlier run's (this engine
            # failed before it loaded), and a device or a pipe cannot be read back
            now = _file_state(stream)
            res = load_stream(stream if now is not None and now != before else os.devnull, len(requests))
            print(f"ENGINE FAILED after {time.time() - t0:.0f} s: {e}\nscoring the {len(requests) - res['skipped']} "
                  f"requests it finished", flush=True)
    cache = prefix_cache_summary(keys, res)
    if cache:
        print(cache, flush=True)
    per, dropped = per_request(samples, keys, res)
    if dropped:
        print(f"{dropped} of {len(samples)} samples not (fully) run: left out of the scores", flush=True)
    total = len(per)
    per, fell_back = without_pool_fallbacks(per)
    if fell_back:
        print(f"{pool_full_message(fell_back, total)}. The samples of those requests are left out of the raw "
              "records and the scores", flush=True)
    if raw_out:
        write_jsonl(raw_out, per)
    rows = aggregate(per)
    if failure is not None and not rows:  # keep an earlier run's file rather than empty it
        raise RuntimeError(f"the engine failed before any sample was scored ({failure}); {out} left as it was")
    write_jsonl(out, rows)
    print(f"wrote {len(rows)} rows to {out}")
    if failure is not None:
        raise RuntimeError(f"the engine failed ({failure}); {out} holds the {len(rows)} rows of the samples it "
                           "finished")
    errors = [p for p in per if p["config_error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} requests had a bad SFI config: {errors[0]['config_error']}")
    if fell_back:
        raise RuntimeError(f"{pool_full_message(fell_back, total)}; {out} holds the samples without them")
    return rows
