"""StepRefresh: a slow step's re-selection for every layer at once, after the step's last layer.

The per-layer refresh (``sfi.slow_refresh = "per_layer"``, :meth:`PackedSFILayer._refresh_packed`) runs
score kernel, Selector, top-K and repack right after each layer's dense attention. Its host cost
is about half a millisecond per layer (launches, small torch ops, stream switches; profiled in a
real engine on the H200: ``benchmarks/results/profile-engine-h200.md``), which at batch 1 makes a
slow step several times a dense one while the device idles.

With ``"per_step"`` a layer only copies its slow rows' queries into a staging buffer (one launch).
When the step ends (:meth:`sfi_vllm.backends.cuda_executor.CudaExecutor.finish`) the work of every layer
runs at once, on the refresh stream when there is one, ordered after the last layer's copy:

* per layer the score kernel, into a ``(C, R, Hkv, G, W)`` logits buffer of ``C`` layers (as many
  as ``LOGITS_BYTES`` allows);
* per ``C`` layers one fused Selector and one top-K over ``C x R`` rows;
* per layer one ``repack_selected`` launch, which also writes the publish's device metadata.

All of it reads device inputs only (staged queries, block-table rows, lengths, budgets, targets),
so it is captured in one CUDA graph per shape (rows, frame bucket, K, sinks, Selector setting,
layers) from the shape's ``CAPTURE_AFTER``-th use and replayed afterwards: one host call per step
instead of a few dozen per layer. The queries staged by the layers of an eager step are padded to
a shape of fewer variants (:func:`padded_shape`: a power-of-two row count and frame while that
stays small; a padding row repeats the first row's inputs and writes nothing), so that a load
whose slow rows come and go in ones and twos reuses a few graphs. The graphs share one memory
pool (their intermediates live only within a replay, and replays run one after another on one
stream), so keeping many of them costs about one graph's memory: ``STEP_MAX_GRAPHS`` are kept,
enough for the shapes of many requests of different lengths (a slow-row count times a frame
bucket each). The host mirrors of the compact buffers are updated at the same
time. A group of rows any of whose rows needs no scoring (its candidates all fit) keeps the
per-layer path. Fast steps of the next step read the new sets because the metadata builder joins
the refresh stream first, as with the per-layer path. What is lost: the per-layer path overlaps
the selection with the next layers' work; here it overlaps only with the step's tail (final norm,
logits, sampling) and the next step's host preparation, unless ``sfi.refresh_overlap`` lets the
next step run beside it (the re-selected rows then read their previous sets for that step; the
refresh first copies the query stages that step rewrites, and its sets are published by a commit
at a later step's start: :class:`sfi_vllm.backends.cuda_executor.CudaExecutor`).

**Fused scores** (``sfi.fused_scores_tokens``, on by default; uniform steps with slow rows only): the
fast-step kernel also writes the slow rows' logits and key norms into :class:`FusedScoreBuffers`,
laid out per group of slow rows as ``(layers, rows, Hkv, G, width)`` (:func:`plan_score_frames`),
and the refresh skips the score kernel. A dense slow row writes them from the keys its attention
reads (the keys read once per slow step instead of twice; measured on the H200:
benchmarks/results/e2e-h200.md). A keys-only slow row (``slow_attention: keys``) reads its keys
for the scores alone, so nothing is saved by reading them inside the fast-step kernel: by default
(``experimental.keys_only_scores: refresh``) the refresh scores the slow rows of such requests
with the score kernel, into their frames of the same buffers (no scratch while their frames
fit, after those of the groups the kernel scores: :func:`plan_score_frames`), and the
step attends for a keys-only row as for a fast row (:func:`scored_in_kernel`). The score kernel's
grid covers every tile of every row, where the fast-step kernel's pass (``fast_kernel``) runs on
the few programs of the attention's splits (a handful per row and KV head) and reads the keys at
about half the GPU's bandwidth, far less when one row of a batch is scored
(benchmarks/results/fused-scores-h200.md).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from sfi_vllm.backends.selection import (
    CAPTURE_AFTER,
    FUSED_MAX_FRAME,
    SlowStepSelection,
    capture_graph,
    log_capture,
    top_k_function,
)
from sfi_vllm.host_copy import copy_to_device, tensor_to_device, to_device
from sfi_vllm.selector import select_batched_static

# Per-step refresh graphs kept (least recently used evicted). They share one memory pool, so more
# graphs cost host memory and capture time, not device memory: a load of many concurrent requests
# of 2-7K tokens (benchmarks/results/serve-bench-smol-h100.md) had 1-7 slow rows per step and
# frames of 4,096-8,192 tokens (3 buckets), and with 4 graphs kept ran 403 of its 535 refreshes
# eagerly.
STEP_MAX_GRAPHS = 64
# padded_shape: jobs are padded while rows x frame stays within this many tokens, and frames only
# up to PAD_MAX_FRAME (the selection's work grows with both; up to here it is small next to the
# launches a graph saves, while a longer frame's work is the device's, and its bucket changes only
# every 2,048 tokens of growth)
PAD_MAX_TOKENS = 1 << 16
PAD_MAX_FRAME = 1 << 14
# Logits + norms of the layers scored together (float32); larger shapes score fewer layers at once.
# One scratch of at most this size (or one layer's, if larger) serves every graph.
LOGITS_BYTES = 256 << 20
# slow_refresh = "auto": per step while a group's slow rows hold at most this many tokens in all, or
# when every row of the group is keys-only (slow_attention keys). On the H200 with slow rows that
# attend densely (benchmarks/results/e2e-h200.md) per step was faster up to 262,144 slow-row tokens
# (1 x 8K to 8 x 32K) and slower at 786,432 (6 x 128K), where the device is busy with the dense
# attention and the per-layer path hides part of the selection behind the next layers; the bound
# lies between the two measured sizes. Keys-only rows leave the device far less to do: at 6 x 128K
# per step was 1.15x per layer end to end (benchmarks/results/e2e-h200-keys.md).
AUTO_MAX_TOKENS = 1 << 19


def scored_in_kernel(cfg) -> bool:
    """Whether the fast-step kernel writes the fused scores of a slow row with this config inside
    the step (else the refresh after the step scores it into the same frames). With
    ``slow_attention: keys`` every slow row of the request is scored after the step, its first
    selection (which attends densely) included, so that in a batch of such requests every slow
    step's refresh has the same body (one graph per shape); the first selection's keys are then
    read twice, once per request."""
    return cfg.slow_attention == "dense" or cfg.experimental.keys_only_scores == "fast_kernel"


def graph_slow_groups(plan) -> dict[tuple, list[int]]:
    """The slow rows of a plan whose step runs as a uniform step, grouped as their refreshes run:
    by Selector setting, sink count and whether the kernel scores them (:func:`scored_in_kernel`),
    in row order."""
    from sfi_vllm.trigger import StepMode

    assert plan.geometry is not None
    groups: dict[tuple, list[int]] = {}
    for r in plan.rows(StepMode.SLOW):
        cfg = plan.configs[r]
        groups.setdefault((cfg.selector, plan.geometry[r].sinks, scored_in_kernel(cfg)), []).append(r)
    return groups


class ScoreFrame(NamedTuple):
    """A group of slow rows' place in the fused score buffers: its first frame token, the frame
    width, and who writes the scores (``in_kernel``: the fast-step kernel during the step; else
    the score kernel in the refresh after it)."""
    offset: int
    width: int
    in_kernel: bool


@dataclass
class FusedScoreBuffers:
    """The fused slow-step scores of every layer (``sfi.fused_scores_tokens``): flat float32
    logits (``tokens x layers x Hq``) and key norms (``tokens x layers x Hkv``), written by the
    fast-step kernel (:class:`sfi_vllm.kernels.fast_decode.ScoreFrames`) for the groups it scores
    and by the refresh's score kernel for the others."""
    logits: torch.Tensor
    norms: torch.Tensor
    tokens: int
    layers: int
    q_heads: int
    kv_heads: int

    @staticmethod
    def bytes_for(tokens: int, layers: int, q_heads: int, kv_heads: int) -> int:
        return tokens * layers * (q_heads + kv_heads) * 4

    @classmethod
    def allocate(cls, tokens: int, layers: int, q_heads: int, kv_heads: int, device) -> "FusedScoreBuffers":
        return cls(torch.empty(tokens * layers * q_heads, dtype=torch.float32, device=device),
                   torch.empty(tokens * layers * kv_heads, dtype=torch.float32, device=device),
                   tokens, layers, q_heads, kv_heads)

    def views(self, offset: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's frames at ``offset`` (frame tokens): logits ``(layers, rows, Hkv, G, width)``
        and norms ``(layers, rows, Hkv, width)``."""
        n = self.layers * rows * width
        g = self.q_heads // self.kv_heads
        return (self.logits[offset * self.q_heads:(offset + n) * self.q_heads].view(
                    self.layers, rows, self.kv_heads, g, width),
                self.norms[offset * self.kv_heads:(offset + n) * self.kv_heads].view(
                    self.layers, rows, self.kv_heads, width))


def plan_score_frames(groups: dict[tuple, list[int]], context: list[int],
                      buffers: FusedScoreBuffers) -> tuple[dict[tuple, ScoreFrame], int]:
    """Each group's :class:`ScoreFrame` in the fused score buffers (groups of
    :func:`graph_slow_groups`), and how many groups got none. A group's frames are every row's
    context rounded up to the Selector's frame width, for every layer. The groups the kernel
    scores are laid out first (only they save a pass over the keys); then those the refresh
    scores. A group that no longer fits gets no frame: the refresh scores it into its scratch."""
    layout, offset, missed = {}, 0, 0
    capacity = buffers.tokens * buffers.layers
    for key, rows in sorted(groups.items(), key=lambda item: not item[0][-1]):  # stable: in-kernel first
        width = SlowStepSelection.frame_width(max(context[r] for r in rows))
        need = buffers.layers * len(rows) * width
        if offset + need > capacity:
            missed += 1
            continue
        layout[key] = ScoreFrame(offset, width, in_kernel=key[-1])
        offset += need
    return layout, missed


def score_row_tables(plan, rows: int) -> torch.Tensor:
    """``(3, rows)`` int32 host table of the fast-step kernel's fused scores: each row's frame
    base, layer stride and width (base ``-1``: the kernel does not score the row)."""
    out = torch.zeros(3, rows, dtype=torch.int32)
    out[0] = -1
    layout = getattr(plan, "score_layout", None) if plan is not None else None
    if not layout:
        return out
    for key, group in graph_slow_groups(plan).items():
        frame = layout.get(key)
        if frame is None or not frame.in_kernel:
            continue
        offset, width = frame.offset, frame.width
        for j, r in enumerate(group):
            out[:, r] = torch.tensor([offset + j * width, len(group) * width, width], dtype=torch.int32)
    return out


def padded_shape(rows: int, width: int) -> tuple[int, int]:
    """The rows and frame width a staged job of ``rows`` slow rows and a ``width``-token frame
    runs with: the rows rounded up to a power of two, and the frame too if it is at most
    ``PAD_MAX_FRAME``, while their product stays within ``PAD_MAX_TOKENS``; else as they are. Padding rows repeat the first row's inputs (so every
    kernel sees real data) and write no set (``repack_selected``'s set ``-1``); positions past a
    row's context are masked, so a wider frame selects the same tokens up to the order of float
    sums (the Selector's kernels split their statistics by the frame's width)."""
    r = 1 << (rows - 1).bit_length()
    w = 1 << (width - 1).bit_length() if width <= PAD_MAX_FRAME else width
    return (r, w) if r * w <= PAD_MAX_TOKENS else (rows, width)


def refresh_per_step(mode: str, contexts: list[int], keys_only: bool = False) -> bool:
    """Whether a group of slow rows with these contexts takes the per-step refresh (``keys_only``:
    every row of the group attends through its compact set)."""
    if mode == "auto":
        return keys_only or sum(contexts) <= AUTO_MAX_TOKENS
    return mode == "per_step"


@dataclass
class _Job:
    """One group of slow rows of one step (one Selector setting and sink count; a uniform step's
    groups also by whether the kernel scored them), with the layers that refresh it."""
    rows: tuple[int, ...]
    cfg: Any  # SFIConfig of the group's first row
    sinks: int
    ctx: list[int]
    ws: list[int]
    k: list[int]
    slots: list[int]
    generations: list[int]
    tok: torch.Tensor  # (P,) token index of each row, padding rows included (P >= R rows)
    bt: torch.Tensor  # (P, max_blocks) int32 block-table rows, padding rows included
    stage: torch.Tensor | None  # (layers, P, Hq, D): the queries staged by record()
    # slow_in_graph: the rows' indices in each layer's own stage (written by the uniform launch)
    rows_idx: list[int] | None = None
    # fused scores: the group's logits (layers, R, Hkv, G, W) and norms (layers, R, Hkv, W), views
    # of the executor's FusedScoreBuffers; their offset; and whether the uniform launch wrote them
    # (else the refresh scores into them)
    scores: tuple[torch.Tensor, torch.Tensor] | None = None
    score_offset: int | None = None
    scored_in_kernel: bool = True
    layers: list = field(default_factory=list)  # SFILayer, in record order
    kv: list = field(default_factory=list)  # (key_cache, value_cache) per recorded layer
    # sfi.refresh_overlap, slow_in_graph rows scored by the refresh: the rows' indices in the
    # layers' stages (on the device), copied into ``stage`` when the flush starts (the next step,
    # which may run beside the refresh, rewrites the layers' stages)
    snapshot_rows: torch.Tensor | None = None
    width: int = 0  # the frame (padded_shape's); 0: the rows' contexts rounded up to the frame bucket


@dataclass
class _Entry:
    bt: torch.Tensor
    seq: torch.Tensor  # (R,) int32
    counts: torch.Tensor  # (C x R,) float32: candidates per row, repeated per layer of a chunk
    budgets: torch.Tensor  # (C x R,) int64
    meta: torch.Tensor  # (layers, 4, R) int32: repack_selected's meta per layer
    rows: torch.Tensor  # (R,) int64: rows_idx on the device (slow_in_graph jobs)
    logits: torch.Tensor  # (C, R, Hkv, G, W) float32 scratch; fused: (layers, R, Hkv, G, W), in place
    norms: torch.Tensor  # (C, R, Hkv, W) float32; fused: (layers, R, Hkv, W)
    pointers: tuple  # the caches and buffers captured (a graph is only valid for the same ones)
    graph: Any = None
    scratch: bool = False  # its logits and norms are views of the shared scratch


class StepRefresh:
    def __init__(self, capture_after: int = CAPTURE_AFTER, max_graphs: int = STEP_MAX_GRAPHS,
                 logits_bytes: int = LOGITS_BYTES, fused_max_frame: int = FUSED_MAX_FRAME) -> None:
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.logits_bytes = logits_bytes
        self.fused_max_frame = fused_max_frame
        self._pending: dict[tuple, _Job] = {}
        self._stages: dict[tuple, torch.Tensor] = {}
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._scratch: torch.Tensor | None = None  # logits + norms, shared by every entry
        self._pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        self._discard: dict = {}  # discard_map's, by shape and device
        self._uses = SlowStepSelection(capture_after=capture_after)  # its use counter
        self._event = None
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def record(self, step, layer, paged, query: torch.Tensor, rows: list[int], tok: torch.Tensor,
               bt: torch.Tensor, sinks: int, num_layers: int) -> None:
        """Stage layer ``layer``'s queries of the slow ``rows`` (all scored) for :meth:`flush`.
        ``query (tokens, Hq, D)``; ``tok``/``bt``: the rows' token indices and block-table rows,
        made once per step."""
        plan = step.plan
        cfg = plan.configs[rows[0]]
        key = (tuple(rows), sinks, cfg.selector)
        job = self._pending.get(key)
        if job is None:
            ctx = [step.seq_lens[r] for r in rows]
            padded, width = padded_shape(len(rows), SlowStepSelection.frame_width(max(ctx)))
            if padded > len(rows):  # padding rows: the first row's inputs again
                tok = torch.cat([tok, tok[:1].expand(padded - len(rows))])
                bt = torch.cat([bt, bt[:1].expand(padded - len(rows), -1)])
            ordinal = sum(1 for j in self._pending.values() if j.tok.shape[0] == padded)
            skey = (padded, ordinal, num_layers, query.shape[1], query.shape[2], query.dtype, query.device)
            stage = self._stages.get(skey)
            if stage is None:
                stage = self._stages[skey] = torch.empty(num_layers, padded, query.shape[1], query.shape[2],
                                                         dtype=query.dtype, device=query.device)
            job = self._pending[key] = _Job(
                rows=tuple(rows), cfg=cfg, sinks=sinks, ctx=ctx,
                ws=[step.geometry[r].window_start for r in rows],
                k=[step.geometry[r].selected for r in rows],
                slots=[plan.slots[r] for r in rows], generations=[plan.generations[r] for r in rows],
                tok=tok, bt=bt, stage=stage, width=width)
        torch.index_select(query, 0, job.tok, out=job.stage[layer.index])
        job.layers.append(layer)
        job.kv.append(paged.nhd_views())
        if query.device.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()

    def stage_graph_slow(self, executor, layers: list, plan, block_table: torch.Tensor) -> None:
        """Jobs for the slow rows of a step that ran as a uniform step (``slow_in_graph``): every
        layer's queries are in its own stage, written by the fast-step kernel; row ``b`` of the
        batch is token ``b``."""
        from sfi_vllm.host_copy import tensor_to_device

        layers = list(layers)
        missing = [l.index for l in layers if l.stage is None or l.kv is None or l.packed is None]
        if missing:
            raise RuntimeError(f"sfi-vllm: slow_in_graph: layers {missing[:4]} have no query stage or KV views "
                               "(their impl did not set them up); this is a bug")
        assert plan.context is not None and plan.geometry is not None
        layout = plan.score_layout or {}
        buffers = executor.fused_scores
        if layout and (buffers is None or buffers.layers != len(layers)
                       or [l.index for l in layers] != list(range(len(layers)))):
            raise RuntimeError("sfi-vllm: fused scores planned for layers the buffers do not hold; this is a bug")
        dev = block_table.device
        snapshots = 0
        for key, rows in graph_slow_groups(plan).items():
            sel, sinks, _ = key
            frame = layout.get(key)
            rows_dev = tensor_to_device(rows, dev)
            ctx = [plan.context[r] for r in rows]
            in_kernel = frame is not None and frame.in_kernel
            job = self._pending[("graph", *key, tuple(rows))] = _Job(
                rows=tuple(rows), cfg=plan.configs[rows[0]], sinks=sinks, ctx=ctx,
                ws=[plan.geometry[r].window_start for r in rows],
                k=[plan.geometry[r].selected for r in rows],
                slots=[plan.slots[r] for r in rows], generations=[plan.generations[r] for r in rows],
                tok=rows_dev, bt=block_table[rows_dev].to(torch.int32), stage=None, rows_idx=list(rows),
                layers=layers, kv=[l.kv for l in layers],
                scores=None if frame is None else buffers.views(frame.offset, len(rows), frame.width),
                score_offset=None if frame is None else frame.offset,
                scored_in_kernel=in_kernel)
            if executor.overlap and not in_kernel:  # the refresh reads the queries: its own copy
                stage0 = layers[0].stage
                skey = ("snapshot", len(rows), snapshots, len(layers), *stage0.shape[1:], stage0.dtype, stage0.device)
                snapshots += 1
                snap = self._stages.get(skey)
                if snap is None:
                    snap = self._stages[skey] = torch.empty(len(layers), len(rows), *stage0.shape[1:],
                                                            dtype=stage0.dtype, device=stage0.device)
                job.stage, job.rows_idx, job.snapshot_rows = snap, None, rows_dev
        if dev.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()  # after the step's last layer

    def flush(self, executor) -> None:
        """Run every staged layer's selection and repack, and publish the new sets (with
        ``sfi.refresh_overlap``: defer their publication to a commit, :class:`CudaExecutor`)."""
        if not self._pending:
            return
        jobs = list(self._pending.values())
        self._pending = {}
        dev = jobs[0].bt.device
        side = executor.refresh_stream(dev)
        layers = len(jobs[0].layers)
        deferred = executor.overlap
        copied = done = None
        if side is None:
            with executor.timed(dev, layers):
                self._copy_stages(executor, jobs)
                published = [self._run(job, deferred) for job in jobs]
        else:
            side.wait_event(self._event)
            executor.refresh_pending = True
            with torch.cuda.stream(side), executor.timed(dev, layers):
                for job in jobs:
                    job.bt.record_stream(side)  # the step's tensors, made on the main stream
                    if job.snapshot_rows is not None:
                        job.snapshot_rows.record_stream(side)
                if self._copy_stages(executor, jobs):
                    copied = torch.cuda.Event()
                    copied.record(side)
                published = [self._run(job, deferred) for job in jobs]
                if deferred:
                    done = torch.cuda.Event()
                    done.record(side)
        if deferred:  # on the main stream, which applies them
            step = executor.step_of_flush()
            for job, (targets, first) in zip(jobs, published):
                executor.defer_commit(
                    step=step, layers=[l.packed for l in job.layers], slots=tensor_to_device(job.slots, dev),
                    targets=to_device(torch.tensor(targets, dtype=torch.int32), dev), first=first,
                    done=done, copied=copied)

    @staticmethod
    def _copy_stages(executor, jobs: list[_Job]) -> bool:
        """The snapshot jobs' queries from the layers' stages into their own (one launch when the
        layers' stages are views of the executor's ``stages``); whether there were any."""
        any_copied = False
        for job in jobs:
            if job.snapshot_rows is None:
                continue
            any_copied = True
            stages = executor.stages
            if stages is not None and len(job.layers) == stages.shape[0] and all(
                    l.stage.data_ptr() == stages[i].data_ptr() for i, l in enumerate(job.layers)):
                torch.index_select(stages, 1, job.snapshot_rows, out=job.stage)
            else:
                for i, layer in enumerate(job.layers):
                    torch.index_select(layer.stage, 0, job.snapshot_rows, out=job.stage[i])
        return any_copied

    def _run(self, job: _Job, deferred: bool = False) -> tuple[list[list[int]], bool]:
        """One job's selection and repack; returns the sets it wrote per layer and slot, and
        whether some slot had no set of its generation before. ``deferred``: the repacks do not
        publish the sets in the slot maps the fast-step kernel reads (the caller commits them)."""
        layers = job.layers
        layer0 = layers[0]
        R, hq = job.bt.shape[0], layer0.num_heads  # rows, padding included
        pad = R - len(job.rows)
        hkv = layer0.num_kv_heads
        g = hq // hkv
        lo, sinks = job.sinks, job.sinks
        width = job.width or SlowStepSelection.frame_width(max(job.ctx))
        kmax = max(job.k)
        per_layer = R * hkv * (g + 1) * width * 4
        chunk = max(1, min(len(layers), self.logits_bytes // per_layer))
        dev = job.bt.device
        if job.scores is not None:  # the fused buffers' frames: written in the step, or scored here
            source = ("fused" if job.scored_in_kernel else "fused-refresh", job.score_offset)
            if job.stage is not None:  # scored here from a snapshot of the stages: that one's
                source += (id(job.stage),)
        else:
            source = "graph" if job.stage is None else id(job.stage)
        if job.scores is not None:
            assert job.scores[0].shape[1:] == (R, hkv, g, width), "fused score frames"
        key = (R, tuple(l.index for l in layers), source, job.bt.shape[1], width, kmax, sinks,
               job.cfg.selector, chunk, hkv, g, dev, deferred)
        pointers = tuple(kc.data_ptr() for kc, _ in job.kv) + tuple(l.packed.keys.data_ptr() for l in layers)
        entry = self._entries.get(key)
        if entry is not None and entry.pointers != pointers:
            self._drop([key])
            entry = None
        if entry is None:
            if len(self._entries) >= self.max_graphs:
                self._drop(list(self._entries)[: len(self._entries) - self.max_graphs + 1])
            n_logits, n_norms = chunk * R * hkv * g * width, chunk * R * hkv * width
            if job.scores is not None:  # the fused frames (the uniform launch writes them, or the body): no scratch
                logits, norms = job.scores
            else:
                scratch = self.scratch(n_logits + n_norms, dev)
                logits = scratch[:n_logits].view(chunk, R, hkv, g, width)
                norms = scratch[n_logits:n_logits + n_norms].view(chunk, R, hkv, width)
            z = dict(dtype=torch.float32, device=dev)
            entry = self._entries[key] = _Entry(
                bt=torch.empty_like(job.bt), seq=torch.empty(R, dtype=torch.int32, device=dev),
                counts=torch.empty(chunk * R, **z), budgets=torch.empty(chunk * R, dtype=torch.long, device=dev),
                meta=torch.empty(len(layers), 4, R, dtype=torch.int32, device=dev),
                rows=torch.empty(R, dtype=torch.long, device=dev),
                logits=logits, norms=norms, pointers=pointers, scratch=job.scores is None)
        self._entries.move_to_end(key)

        # this step's inputs, into the entry's static tensors
        entry.bt.copy_(job.bt)
        targets = [[l.packed.target(s) for s in job.slots] for l in layers]
        first = not all(layer0.packed.valid(s, gen) for s, gen in zip(job.slots, job.generations))
        discard = self.discard_map(layer0.packed) if deferred else None
        counts = [sinks + kk for kk in job.k]
        # padding rows: the first row's inputs, and set -1 (repack_selected writes nothing for them)
        ctx, ws, k = (v + v[:1] * pad for v in (job.ctx, job.ws, job.k))
        meta = torch.tensor([[t + [-1] * pad, counts + counts[:1] * pad, ws, job.slots + job.slots[:1] * pad]
                             for t in targets], dtype=torch.int32)
        copy_to_device(entry.meta, meta)
        copy_to_device(entry.seq, torch.tensor(ctx, dtype=torch.int32))
        copy_to_device(entry.counts, torch.tensor([w - lo for w in ws] * chunk, dtype=torch.float32))
        copy_to_device(entry.budgets, torch.tensor(k * chunk, dtype=torch.long))
        if job.rows_idx is not None:
            copy_to_device(entry.rows, torch.tensor(job.rows_idx, dtype=torch.long))

        selector = layer0.selector(job.cfg)
        fused = selector.cfg.smooth_kernel <= 1 and width <= self.fused_max_frame
        top_k = top_k_function(job.cfg.experimental.selector_top_k, selector.cfg.page_size)  # an engine-wide setting
        scale = layer0.scale

        def body() -> None:
            from sfi_vllm.kernels.repack import repack_selected
            from sfi_vllm.kernels.selector_scores import selector_scores
            from sfi_vllm.kernels.slow_scores import slow_step_scores

            for c0 in range(0, len(layers), chunk):
                part = range(c0, min(c0 + chunk, len(layers)))
                nc = len(part)
                # the fused frames hold every layer; the scratch the chunk's layers
                first = c0 if job.scores is not None else 0
                if not (job.scores is not None and job.scored_in_kernel):  # else in place already
                    for i, li in enumerate(part):
                        if job.stage is not None:
                            q = job.stage[layers[li].index]
                        else:  # slow_in_graph: the rows' queries from the layer's own stage
                            q = torch.index_select(layers[li].stage, 0, entry.rows)
                        slow_step_scores(q, job.kv[li][0], entry.bt, entry.seq, width, scale,
                                         out=(entry.logits[first + i], entry.norms[first + i]))
                lg = entry.logits[first:first + nc].flatten(0, 1)
                nm = entry.norms[first:first + nc].flatten(0, 1)
                cnt, bud = entry.counts[: nc * R], entry.budgets[: nc * R]
                if fused:
                    sel = top_k(selector_scores(selector.cfg, lg, nm, lo, cnt), lo, bud, kmax)
                else:
                    sel = select_batched_static(selector, torch.softmax(lg, dim=-1), nm, lo, cnt, bud, kmax)
                sel = sel.reshape(nc, R, hkv, kmax)
                for i, li in enumerate(part):
                    buf = layers[li].packed
                    kc, vc = job.kv[li]
                    repack_selected(kc, vc, entry.bt, sel[i], sinks, entry.meta[li], buf.keys, buf.values,
                                    buf.length_dev, buf.window_start_dev,
                                    buf.slot_map_dev if discard is None else discard)

        if dev.type != "cuda":
            body()
        elif entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        elif self._uses.count_use(key):
            t0 = time.perf_counter()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            entry.graph, _ = capture_graph(body, pool=self._pool)
            entry.graph.replay()
            self.captures += 1
            log_capture("the per-step refresh's", self.captures, time.perf_counter() - t0,
                        f"{len(job.rows)} slow rows{f' padded to {R}' if pad else ''}, a {width}-token frame, "
                        f"{len(layers)} layers, scores "
                        f"{source[0] if job.scores is not None else 'from the stage'}, "
                        f"{len(self._entries)} graphs kept")
        else:
            body()
            self.eager_runs += 1
        for layer, t in zip(layers, targets):
            layer.packed.publish_host(job.slots, job.generations, t, counts, job.ws)
        return targets, first

    def discard_map(self, buf) -> torch.Tensor:
        """Where a deferred repack's slot-map write goes: a map of the same shape that nothing reads
        (the physical set's length and window start it writes belong to the spare set, which no
        step reads before the commit)."""
        key = (tuple(buf.slot_map_dev.shape), buf.slot_map_dev.device)
        m = self._discard.get(key)
        if m is None:  # kept: captured graphs hold its address
            m = self._discard[key] = torch.zeros_like(buf.slot_map_dev)
        return m

    def scratch(self, numel: int, device) -> torch.Tensor:
        """The shared logits + norms scratch, at least ``numel`` float32 on ``device``. A larger
        one replaces it, and the entries that read the old one go with it (their graphs hold its
        address); entries with fused scores read their own buffers and stay."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors say it
            device = torch.device("cuda", torch.cuda.current_device())
        if self._scratch is None or self._scratch.numel() < numel or self._scratch.device != device:
            self._drop([k for k, e in self._entries.items() if e.scratch])
            self._scratch = None
            self._scratch = torch.empty(self.scratch_numel(numel, device), dtype=torch.float32, device=device)
        return self._scratch

    def scratch_numel(self, numel: int, device: torch.device) -> int:
        """The size of a new scratch for a job that needs ``numel`` floats: on a GPU at once what
        the largest chunk may take (``logits_bytes``; more if one layer needs more), since every
        growth drops the graphs that read the old scratch, and jobs of different shapes would
        otherwise grow it step by step (recapturing each time); elsewhere (the tests' CPU runs)
        what is asked."""
        return max(numel, self.logits_bytes // 4) if device.type == "cuda" else numel

    def _drop(self, keys: list) -> None:
        """Forget entries. The graphs' shared memory pool returns to the allocator when its last
        graph goes, without waiting for a replay still running: wait for the refresh work first.
        A pool whose graphs are all gone cannot take another capture (the allocator has released
        it), so the next capture makes a new one."""
        entries = [self._entries.pop(k) for k in keys]
        for k in keys:
            self._uses.forget(k)
        if any(e.graph is not None for e in entries) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the refresh stream inside flush()
        if not any(e.graph is not None for e in self._entries.values()):
            self._pool = None
