"""CudaExecutor: the kernel path's device resources and its part of each step.

One per engine (per :class:`~sfi_vllm.controller.SFIController`), attached when the CUDA impl
builds its first layer on the Triton kernels (:func:`executor_for`, from its compact buffers). It owns what the layers share on that path:

* the refresh stream a slow step's selection and repack run on (``side_stream``), and the join
  that orders a step's kernels after the previous step's refresh;
* the slow step's selection graphs (:class:`~sfi_vllm.backends.selection.SlowStepSelection`) and
  the per-step refresh (:class:`~sfi_vllm.backends.step_refresh.StepRefresh`);
* the uniform fast path's workspace, the fused slow-step score buffers and whether the layers
  stage their queries (``slow_in_graph``).

**Overlap** (``sfi.refresh_overlap``, :meth:`join_refresh`): a per-step refresh does not publish
its sets itself. Its repacks write the spare sets, and the slot maps the fast-step kernel reads
are updated by a *commit* on the main stream at the start of a later step, after that step has
waited for the refresh. A step waits only for the refreshes enqueued before the previous step
ended, so the previous step's refresh runs beside it, and the rows it re-selected read their
previous sets for that one step. What the refresh reads that the next step overwrites (the
layers' query stages) it copies first, and the next step waits for that copy only. A step waits
for every refresh when it cannot run beside one (see :meth:`join_refresh`).

The controller makes the host-side :class:`~sfi_vllm.controller.StepPlan`; :meth:`plan` adds
what only this path decides (slow rows inside the step's CUDA graph, their score frames), the
metadata builder and the layers run the step, and :meth:`finish` ends it (the staged per-step
refresh). The reference path (CPU, ``kernels: torch``) has no executor. Nothing here touches a
GPU until a layer asks for a stream, so the Triton-interpreter tests run it on the CPU.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sfi_vllm.backends.selection import SlowStepSelection
from sfi_vllm.backends.step_refresh import StepRefresh, graph_slow_groups, plan_score_frames, refresh_per_step
from sfi_vllm.compact import RowGeometry
from sfi_vllm.config import SFIConfig
from sfi_vllm.trigger import StepMode

logger = logging.getLogger(__name__)


# refresh timings waiting for their events (bounded: a GPU that never finishes them would stall long before)
MAX_PENDING_TIMINGS = 4096


@dataclass
class Commit:
    """The slot-map writes that publish one flush's sets (``sfi.refresh_overlap``): for each layer
    ``maps[layer][slots] = targets[layer]``, applied on the main stream once it has waited for
    ``done`` (recorded on the refresh stream after the flush's repacks; None inline)."""
    step: int  # the controller's planned_steps when the flush ran (the step whose end flushed it)
    layers: list  # PackedCompactBuffer per layer, in the order of targets' rows
    slots: torch.Tensor  # (R,) int64, on the device
    targets: torch.Tensor  # (layers, R) int32, on the device
    first: bool  # some row had no set of its generation: it may not read the slot before this lands
    done: object = None  # torch.cuda.Event
    copied: object = None  # torch.cuda.Event after the flush copied the query stages it reads


class CudaExecutor:
    def __init__(self, cfg: SFIConfig, observe_selection=None) -> None:
        self.cfg = cfg
        # called with the seconds of one layer's selection and repack (sfi_selection_seconds)
        self.observe_selection = observe_selection
        self._timings: deque = deque(maxlen=MAX_PENDING_TIMINGS)  # (start event, end event, layers)
        self.fast_workspace: torch.Tensor | None = None  # the uniform fast path's scratch (set by the impl)
        # every layer's fused slow-step scores (FusedScoreBuffers, set by the impl when
        # ``fused_scores_tokens`` resolves to more than 0); steps whose slow rows do not fit are counted
        self.fused_scores = None
        self.fused_score_misses = 0
        # set by an impl whose layers stage their queries in the uniform launch (``graph_slow_enabled``):
        # only then may a plan put slow rows in a full graph
        self.graph_slow_ready = False
        self.slow_selection = SlowStepSelection(top_k=cfg.experimental.selector_top_k)
        self.step_refresh = StepRefresh()
        self.refresh_pending = False  # work on the refresh stream not yet joined
        self._refresh_stream = None
        self._graph_slow: tuple | None = None  # (plan, block table) of a uniform step with slow rows
        # sfi.refresh_overlap: flushes whose sets are not published yet, oldest first; a
        # per-layer refresh (which publishes itself) since the last full join; and the tensors
        # every layer's query stage and slot map are views of, when the impl allocated them so
        # (one launch then copies or updates all layers; None: one per layer)
        self.overlap = cfg.overlap_enabled and cfg.kernels != "torch"
        self.commits: deque[Commit] = deque()
        self.direct_pending = False
        self.stages: torch.Tensor | None = None  # (layers, rows, Hq, D)
        self.live_maps: torch.Tensor | None = None  # (layers, slots) int32
        # the controller's planned_steps (set by executor_for): the step a flush belongs to
        self.step_of_flush = lambda: 0

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, plan, slow: list[int]) -> None:
        """Put the plan's slow rows inside the step's CUDA graph (``plan.graph_slow``) where they
        can all be refreshed after the step from staged queries, with their fused score frames."""
        plan.graph_slow = self._slow_rows_fit_graph([plan.configs[i] for i in slow],
                                                    [plan.geometry[i] for i in slow],
                                                    all(plan.attends_set(i) for i in slow))
        if plan.graph_slow and self.fused_scores is not None:
            plan.score_layout = self._score_layout(plan)

    def _slow_rows_fit_graph(self, cfgs: list[SFIConfig], geometry: list[RowGeometry],
                             keys_only: bool = False) -> bool:
        """Per-step refresh, every layer, the Selector needed for every row (``geometry``: the
        rows' at the step's context; ``keys_only``: every row attends through its compact set)."""
        contexts = [g.context for g in geometry]
        if not (self.graph_slow_ready and self.cfg.graph_slow_enabled) or not refresh_per_step(
                self.cfg.slow_refresh, contexts, keys_only):
            return False
        for cfg, g in zip(cfgs, geometry):  # (lossless mode re-selects every layer, interleaved or not)
            if cfg.interleaved_refresh_applies or cfg.policy == "quest" or not g.scored:
                return False
        return True

    def _score_layout(self, plan) -> dict | None:
        """The groups' frames in the fused score buffers (None: no group got one); a step in which
        some group got none is counted in ``fused_score_misses``."""
        layout, missed = plan_score_frames(graph_slow_groups(plan), plan.context, self.fused_scores)
        if missed:
            if self.fused_score_misses == 0:
                logger.warning(
                    "sfi-vllm: a slow step's rows need more frame tokens than fused_scores_tokens (%d) "
                    "holds; a group of slow rows that does not fit is scored into a scratch buffer "
                    "after the step (counted in fused_score_misses)", self.fused_scores.tokens)
            self.fused_score_misses += 1
        return layout or None

    def note_graph_slow(self, plan, block_table: torch.Tensor) -> None:
        """The metadata builder made a uniform step of a plan with slow rows: they are refreshed
        when the step ends, from the queries the fast-step kernel staged."""
        self._graph_slow = (plan, block_table)

    @property
    def has_staged_work(self) -> bool:
        """Refresh work of the step or drafter pass that just ran, not yet enqueued: a staged
        per-step refresh, or slow rows that ran inside a uniform launch (:meth:`finish` runs it)."""
        return self._graph_slow is not None or bool(self.step_refresh.pending)

    # -- the refresh stream -----------------------------------------------------------------------
    def refresh_stream(self, device: torch.device):
        """The CUDA stream slow steps' selection and repack run on, or None (inline): CPU, or
        ``side_stream`` off. Work enqueued on it must be joined (:meth:`join_refresh`) before
        anything reads the compact sets it writes."""
        if device.type != "cuda" or not self.cfg.side_stream:
            return None
        if self._refresh_stream is None:
            self._refresh_stream = torch.cuda.Stream(device)
        return self._refresh_stream

    def fork_refresh(self, device: torch.device):
        """Order the refresh stream after everything enqueued so far on the current stream (this
        layer's KV-cache writes and dense attention) and return it (None: run inline). For the
        per-layer refresh, which publishes its sets itself: the next step waits for all of it."""
        side = self.refresh_stream(device)
        self.direct_pending = True
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
            self.refresh_pending = True
        return side

    def join_refresh(self, plan=None, step: int | None = None) -> None:
        """Order the step about to be built after the refresh work it must see. Called by the
        metadata builder for every step once it has written the step's tables (nothing the refresh
        reads) and before any of the step's kernels is enqueued,
        so the step's fast rows (eager or replayed from a full CUDA graph) read complete sets only.

        Without overlap, or for a step that cannot run beside a refresh, the current stream waits
        for all refresh work and every pending commit is applied. With ``sfi.refresh_overlap``,
        for ``plan`` (planned as the controller's step ``step``): commits of flushes before the
        previous step's end are applied after their refreshes; the previous step's flush keeps
        running, and the step waits only for its copy of the query stages. It waits for everything
        when ``plan`` is None (warm-up, capture, and every step the builder does not make a uniform
        one: those run eagerly, and an eager step's per-step refresh stages queries the running
        refresh may still read), has prefill rows or slow rows that run eagerly, has slow rows
        whose scores the fast-step kernel writes (the frames the running refresh may read), when a
        per-layer refresh ran since, or when the pending flush makes some row's first selection."""
        if (not self.overlap or plan is None or step is None or plan.needs_eager or self.direct_pending
                or any(m == StepMode.PREFILL for m in plan.modes)
                or _writes_score_frames(plan) or any(c.first for c in self.commits)):
            self._join_all()
            return
        while self.commits and self.commits[0].step < step - 1:
            commit = self.commits.popleft()
            if commit.done is not None:
                torch.cuda.current_stream(self._refresh_stream.device).wait_event(commit.done)
            apply_commit(commit, self.live_maps)
        for commit in self.commits:  # the previous step's flush: only its copy of the stages
            if commit.copied is not None:
                torch.cuda.current_stream(self._refresh_stream.device).wait_event(commit.copied)

    def _join_all(self) -> None:
        if self.refresh_pending:
            torch.cuda.current_stream(self._refresh_stream.device).wait_stream(self._refresh_stream)
            self.refresh_pending = False
        while self.commits:
            apply_commit(self.commits.popleft(), self.live_maps)
        self.direct_pending = False

    def defer_commit(self, **fields) -> None:
        """A flush's publication (:class:`Commit`'s fields), applied by a later :meth:`join_refresh`."""
        self.commits.append(Commit(**fields))

    # -- timing the refresh ------------------------------------------------------------------------
    @contextmanager
    def timed(self, device: torch.device, layers: int):
        """Time the selection and repack work enqueued inside on the current stream with a pair of
        CUDA events, read back later without waiting (:meth:`collect_timings`) as ``layers``
        observations of an equal share. Not on the CPU (the reference path times itself on the
        host) and not while the stream is capturing a CUDA graph."""
        if device.type != "cuda" or self.observe_selection is None or torch.cuda.is_current_stream_capturing():
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._timings.append((start, end, layers))

    def collect_timings(self) -> None:
        """Observe every timed refresh whose end event has completed, oldest first; never waits."""
        while self._timings and self._timings[0][1].query():
            start, end, layers = self._timings.popleft()
            share = start.elapsed_time(end) / 1e3 / max(layers, 1)  # elapsed_time is in ms
            for _ in range(max(layers, 1)):
                self.observe_selection(share)

    def graph_runs(self) -> dict[str, int]:
        """The selection's runs so far (per-step and per-layer refresh together), by how they ran:
        replayed from a captured graph, captured, or eager (sfi_cuda_graph_runs)."""
        step, layer = self.step_refresh, self.slow_selection
        return {"replay": step.replays + layer.replays, "capture": step.captures + layer.captures,
                "eager": step.eager_runs + layer.eager_runs}

    # -- the end of a step ------------------------------------------------------------------------
    def finish(self, layers: list) -> None:
        """After the step's forward: stage the refresh of slow rows that ran inside the graph, then
        run every staged per-step refresh (``slow_refresh = "per_step"``), and observe the refresh
        timings that have completed."""
        if self._graph_slow is not None:
            plan, block_table = self._graph_slow
            self._graph_slow = None
            self.step_refresh.stage_graph_slow(self, layers, plan, block_table)
        self.step_refresh.flush(self)
        self.collect_timings()


def _writes_score_frames(plan) -> bool:
    """Whether a uniform step's fast-step kernel writes fused score frames (slow rows attending
    densely, or keys-only rows scored in the kernel)."""
    layout = getattr(plan, "score_layout", None) or {}
    return bool(plan.graph_slow) and any(frame.in_kernel for frame in layout.values())


def apply_commit(commit: Commit, live_maps: torch.Tensor | None) -> None:
    """``maps[layer][slots] = targets[layer]`` for the commit's layers, on the current stream: one
    launch when the layers are every row of ``live_maps`` in order, else one per layer."""
    bufs = commit.layers
    if live_maps is not None and len(bufs) == live_maps.shape[0] and all(
            b.slot_map_dev.data_ptr() == live_maps[i].data_ptr() for i, b in enumerate(bufs)):
        live_maps[:, commit.slots] = commit.targets
        return
    for buf, targets in zip(bufs, commit.targets):
        buf.slot_map_dev[commit.slots] = targets


def executor_for(controller) -> CudaExecutor:
    """The controller's kernel-path executor, created on first use."""
    if controller.executor is None:
        controller.executor = CudaExecutor(controller.cfg, controller.stats.observe_selection)
        controller.executor.step_of_flush = lambda: controller.planned_steps
    return controller.executor
