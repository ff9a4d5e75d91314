"""Per-request SFI statistics: how many steps were dense, slow and fast, why each slow step fired,
and how many tokens the fast steps attended to compared with the context.

Collected in the worker process. Finished requests are kept for in-process readers (`sfi-vllm
demo`, the batch and benchmark tools, tests): the newest ``KEEP_FINISHED``, fewer where their
slow-step events would pass ``KEEP_FINISHED_EVENTS`` (a request may record up to ``MAX_EVENTS``,
and in a server nothing reads them: it holds a few tens of MB of them at most). They are logged,
and optionally appended as JSON lines to ``SFIConfig.stats_file`` so that a server's statistics
survive its worker processes.

A worker learns that a request has finished from the next step's scheduler output (vLLM runs
that step while it has finished requests to report), so the last requests before the engine
stops may not be retired yet. When the worker process exits,
those still open are appended too, with ``"retired": false`` (their figures cover every step the
worker ran for them; the request may have finished, been aborted, or still been running). Records
written as requests retire carry ``"retired": true``.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field

from sfi_vllm.trigger import SlowReason, StepMode

logger = logging.getLogger("sfi_vllm")
KEEP_FINISHED = 10_000
MAX_EVENTS = 4096  # slow-step events kept per request
KEEP_FINISHED_EVENTS = 1 << 18  # slow-step events over the kept finished requests (about 35 MB)
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(req_id: str) -> str:
    """The caller's request id (an HTTP response's ``id``) of vLLM's internal one: vLLM appends
    ``-<8 hex>`` to the caller's id, unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set; strip
    it. A sequence of a request with ``n`` > 1 keeps vLLM's ``<index>_`` before the id."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0").strip() not in ("", "0"):
        return req_id
    return _INTERNAL_SUFFIX.sub("", req_id)


@dataclass
class RequestStats:
    req_id: str
    prompt_tokens: int = 0
    prefill_steps: int = 0
    dense_steps: int = 0
    slow_steps: int = 0
    fast_steps: int = 0
    slow_reasons: Counter = field(default_factory=Counter)
    # (decode step index, context length, reason) of each slow step, oldest first
    slow_events: list[tuple[int, int, str]] = field(default_factory=list)
    # sums over fast steps and layers (GPU kernel path: over fast steps, from the first layer's
    # compact set): tokens attended, and the context they stood for
    fast_attended_tokens: int = 0
    fast_context_tokens: int = 0
    fast_layer_evals: int = 0
    # sums of the context over decode steps: those that attended densely (dense and slow steps), all
    full_context_tokens: int = 0
    decode_context_tokens: int = 0
    preemptions: int = 0
    # reuse_stagger: how much shorter than reuse_budget the interval after the last first
    # selection is (sfi_vllm.trigger.reuse_offset)
    reuse_offset: int = 0
    policy: str = "sfi"
    # sfi.mode lossless: the model's steps that verified drafted tokens, the tokens drafted for them
    # and those it accepted (each verify step also samples one token of its own)
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # why the request ran with dense attention instead of the SFI settings it asked for (None: it
    # did not); config_error holds the message when the reason is "config_error"
    fallback: str | None = None
    config_error: str | None = None

    @property
    def decode_steps(self) -> int:
        return self.dense_steps + self.slow_steps + self.fast_steps

    @property
    def mean_attended_per_fast_step(self) -> float:
        return self.fast_attended_tokens / self.fast_layer_evals if self.fast_layer_evals else 0.0

    @property
    def mean_context_per_fast_step(self) -> float:
        return self.fast_context_tokens / self.fast_layer_evals if self.fast_layer_evals else 0.0

    @property
    def attended_fraction(self) -> float:
        return self.fast_attended_tokens / self.fast_context_tokens if self.fast_context_tokens else 0.0

    @property
    def decode_attended_fraction(self) -> float:
        """Tokens attended over all decode steps (fast steps their working set, dense and slow steps
        the whole context: a keys-only slow step reads every key to re-select) / the context they
        stood for."""
        if not self.decode_context_tokens:
            return 0.0
        fast = self.fast_steps * self.mean_attended_per_fast_step
        return (fast + self.full_context_tokens) / self.decode_context_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step: the accepted drafts and the model's own token (0: no verify)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_id"] = external_request_id(self.req_id)
        d["acceptance_length"] = round(self.acceptance_length, 3)
        d["slow_reasons"] = dict(self.slow_reasons)
        d["decode_steps"] = self.decode_steps
        d["mean_attended_per_fast_step"] = round(self.mean_attended_per_fast_step, 2)
        d["mean_context_per_fast_step"] = round(self.mean_context_per_fast_step, 2)
        d["attended_fraction"] = round(self.attended_fraction, 4)
        d["decode_attended_fraction"] = round(self.decode_attended_fraction, 4)
        return d


REASON_NAMES = {
    SlowReason.FIRST_DECODE: "first_decode",
    SlowReason.REUSE_BUDGET: "reuse_budget",
    SlowReason.BOUNDARY: "boundary",
    SlowReason.VERIFY: "verify",
    SlowReason.BRIDGE_END: "bridge_end",
}
# why a request ran densely instead of its SFI settings (its statistics' ``fallback``)
FALLBACK_REASONS = ("config_error", "compact_pool_full")


class StatsRegistry:
    """Per-request statistics of one worker. With ``metrics`` (:class:`sfi_vllm.metrics.SFIMetrics`)
    the same calls feed SFI's Prometheus metrics: tallied here, written by :meth:`flush_metrics`
    once per engine step."""

    def __init__(self, stats_file: str | None = None, metrics=None) -> None:
        self._lock = threading.Lock()
        self.metrics = metrics
        self._steps: Counter = Counter()
        self._fast_sums = [0, 0, 0]  # attended, context, evaluations
        self._graph_totals: dict[str, dict[str, int]] = {}  # note_graph_runs' last totals
        self.active: dict[str, RequestStats] = {}
        self.finished: OrderedDict[str, RequestStats] = OrderedDict()
        self._finished_events = 0  # slow-step events over self.finished
        self._pool: tuple[int, int] | None = None  # the last values note_pool wrote
        self.stats_file = stats_file
        self._write_failed = False
        if stats_file:
            try:  # at start-up, not at the first finished request: a bad path stops the engine here
                with open(stats_file, "a"):
                    pass
            except OSError as e:
                from sfi_vllm.config import SFIConfigError

                raise SFIConfigError(f"sfi.stats_file: cannot append to {stats_file!r} ({e.strerror or e}); "
                                     "give a writable file in an existing directory") from None
            # a process that multiprocessing forked (vLLM's workers and engine core unless it
            # spawns them) leaves through os._exit, which runs multiprocessing's exit finalizers but
            # not atexit's; a plain interpreter runs atexit's. write_open_requests forgets what it
            # wrote, so running from both writes each request once; a process forked from this one
            # (the pid differs) writes nothing of this one's
            self._pid = os.getpid()
            atexit.register(self._write_open_at_exit)
            multiprocessing.util.Finalize(None, self._write_open_at_exit, exitpriority=10)

    def get(self, req_id: str) -> RequestStats:
        st = self.active.get(req_id)
        if st is None:
            st = self.active[req_id] = RequestStats(req_id)
        return st

    def record_step(self, req_id: str, mode: int, reason: int, context_len: int,
                    prompt_len: int | None = None) -> None:
        """One step of the request. A prefill chunk records ``prompt_len``, the prompt's length
        (None: the longest context a prefill chunk reached)."""
        st = self.get(req_id)
        if mode == StepMode.PREFILL:
            st.prefill_steps += 1
            st.prompt_tokens = prompt_len if prompt_len is not None else max(st.prompt_tokens, context_len)
            self._steps["prefill", None] += 1
            return
        st.decode_context_tokens += context_len
        if mode == StepMode.DENSE:
            st.dense_steps += 1
            st.full_context_tokens += context_len
            self._steps["dense", None] += 1
        elif mode == StepMode.FAST:
            st.fast_steps += 1
            self._steps["fast", None] += 1
        else:
            st.slow_steps += 1
            st.full_context_tokens += context_len
            name = REASON_NAMES[SlowReason(reason)]
            st.slow_reasons[name] += 1
            self._steps["slow", name] += 1
            if len(st.slow_events) < MAX_EVENTS:
                st.slow_events.append((st.decode_steps - 1, context_len, name))

    def record_steps(self, req_ids, modes, reasons, contexts, prompt_lens) -> None:
        """:meth:`record_step` for each row of a step, in one call: fast rows (most rows of most
        steps) counted inline, the others through :meth:`record_step`."""
        fast, active = int(StepMode.FAST), self.active
        n_fast = 0
        for req_id, mode, reason, ctx, prompt_len in zip(req_ids, modes, reasons, contexts, prompt_lens):
            if mode != fast:
                self.record_step(req_id, mode, reason, ctx, prompt_len)
                continue
            st = active.get(req_id)
            if st is None:
                st = self.get(req_id)
            st.decode_context_tokens += ctx
            st.fast_steps += 1
            n_fast += 1
        if n_fast:
            self._steps["fast", None] += n_fast

    def record_verify(self, req_id: str, drafted: int) -> None:
        """sfi.mode lossless: the model verified ``drafted`` tokens of the request this step."""
        st = self.get(req_id)
        st.verify_steps += 1
        st.drafted_tokens += drafted
        self._steps["verify", None] += 1
        self._steps["drafted", None] += drafted

    def record_accepted(self, req_id: str, accepted: int) -> None:
        """sfi.mode lossless: of the tokens last verified, the model accepted ``accepted``."""
        self.get(req_id).accepted_tokens += accepted
        self._steps["accepted", None] += accepted

    def record_fast_layer(self, req_id: str, attended: int, context_len: int) -> None:
        st = self.get(req_id)
        st.fast_attended_tokens += attended
        st.fast_context_tokens += context_len
        st.fast_layer_evals += 1
        sums = self._fast_sums
        sums[0] += attended
        sums[1] += context_len
        sums[2] += 1

    def note_fallback(self, req_id: str, reason: str, detail: str | None = None) -> None:
        """The request runs with dense attention instead of its SFI settings, for ``reason`` (one
        of ``FALLBACK_REASONS``, the label values the metrics start with). Another reason is a
        bug of the caller: logged, and counted all the same (the request is served densely, so
        this must not stop the engine)."""
        if reason not in FALLBACK_REASONS:
            logger.error("sfi-vllm: fallback reason %r is not one of %s", reason, ", ".join(FALLBACK_REASONS))
        st = self.get(req_id)
        if st.fallback == reason:  # the same request again (after a preemption): counted once
            return
        st.fallback = reason
        if reason == "config_error":
            st.config_error = detail
        if self.metrics is not None:
            self.metrics.fallbacks.labels(reason=reason).inc()

    def flush_metrics(self) -> None:
        """Write the step tallies gathered since the last call to the metrics (once per step)."""
        if self.metrics is None or not (self._steps or self._fast_sums[2]):
            return
        self.metrics.write(self._steps, self._fast_sums)
        self._steps = Counter()
        self._fast_sums = [0, 0, 0]

    def note_pool(self, in_use: int, total: int) -> None:
        """The compact sets held by requests in flight, and the pool's; written when they change."""
        if self.metrics is None or self._pool == (in_use, total):
            return
        self._pool = (in_use, total)
        self.metrics.compact_sets_in_use.set(in_use)
        self.metrics.compact_sets.set(total)

    def note_graph_runs(self, what: str, totals: dict[str, int]) -> None:
        """``totals``: the running counts of one user of CUDA graphs (``what``: "selection",
        "drafter") by how its work ran ("replay", "capture", "eager"); the metrics get what each
        grew by since the last call."""
        last = self._graph_totals.setdefault(what, {})
        for how, n in totals.items():
            grown = n - last.get(how, 0)
            if grown > 0 and self.metrics is not None:
                self.metrics.graph_runs.labels(what=what, how=how).inc(grown)
            last[how] = n

    def observe_selection(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.selection_seconds.observe(seconds)

    def finish(self, req_id: str, preempted: bool = False) -> None:
        if preempted:
            if req_id in self.active:
                self.active[req_id].preemptions += 1
                self._steps["preempted", None] += 1
            return
        st = self.active.pop(req_id, None)
        if st is None:
            return
        if self.metrics is not None:
            self.metrics.requests.labels(policy=st.policy).inc()
            if st.fast_context_tokens:
                self.metrics.attended_fraction.observe(st.attended_fraction)
        with self._lock:
            earlier = self.finished.pop(req_id, None)  # an id used again: the newer record replaces it
            if earlier is not None:
                self._finished_events -= len(earlier.slow_events)
            self.finished[req_id] = st
            self._finished_events += len(st.slow_events)
            while len(self.finished) > KEEP_FINISHED or (
                    self._finished_events > KEEP_FINISHED_EVENTS and len(self.finished) > 1):
                _, old = self.finished.popitem(last=False)
                self._finished_events -= len(old.slow_events)
        logger.debug("sfi request %s: %s", req_id, st.to_dict())
        if self.stats_file:
            self._append([{**st.to_dict(), "retired": True}])

    def _append(self, records: list[dict]) -> None:
        """Append records to the stats file. A write that fails while serving (the disk full, the
        file's directory removed) is logged, once, and the engine goes on: the statistics are a
        by-product, and an exception here would stop every running request."""
        try:
            with open(self.stats_file, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
            self._write_failed = False
        except OSError as e:
            if not self._write_failed:
                logger.error("sfi-vllm: could not append request statistics to %s (%s); requests go on, "
                             "their lines are lost until a write succeeds", self.stats_file, e)
            self._write_failed = True

    def write_open_requests(self) -> int:
        """Append the requests not yet retired to the stats file, marked ``"retired": false``, and
        forget them (run at process exit); returns how many."""
        with self._lock:
            pending, self.active = list(self.active.values()), {}
        if not self.stats_file or not pending:
            return 0
        self._append([{**st.to_dict(), "retired": False} for st in pending])
        return len(pending)

    def _write_open_at_exit(self) -> None:
        if os.getpid() == self._pid:
            self.write_open_requests()

    def lookup(self, req_id: str) -> RequestStats | None:
        """One request's statistics, running or finished (None: not seen, or no longer kept)."""
        with self._lock:
            return self.active.get(req_id) or self.finished.get(req_id)

    def snapshot(self) -> dict[str, RequestStats]:
        with self._lock:
            return {**self.finished, **self.active}
