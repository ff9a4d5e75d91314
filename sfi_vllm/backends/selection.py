"""SlowStepSelection: the GPU slow step's selection work, captured in CUDA graphs.

A slow step re-selects every layer's compact set: score kernel (``sfi_vllm.kernels.slow_scores``),
then the Selector's scores (``sfi_vllm.kernels.selector_scores``: three launches, for frames up
to ``FUSED_MAX_FRAME``; the torch Selector, about a hundred small ops, for longer frames and for
evidence smoothing) and top-K. Launched one by one
the torch version was bound by the host (measured on the H200: 2.4 ms of launch time per layer for
0.8 ms of GPU time at 8 x 32K). The shapes depend only on the number of slow rows, the candidate
frame and K, so the work is captured once per shape in a CUDA graph and replayed for every layer
and every later slow step of that shape:

* the frame width is the largest context rounded up to ``WIDTH_BUCKET`` tokens (positions past a
  row's context are masked), so a new graph is needed only every ``WIDTH_BUCKET`` tokens of growth;
* per-row candidate counts and budgets are device inputs of the graph; the score kernel (whose
  key-cache pointer differs per layer) runs outside the graph into the graph's static input.

The newest ``MAX_GRAPHS`` graphs are kept (least recently used evicted, and its use count with
it). A shape is captured only from the ``CAPTURE_AFTER``-th engine step that uses it on (the
layers of a step count once); before that its work runs eagerly. Capturing is expensive
(``torch.cuda.graph`` synchronises the device and empties the caching allocator), and a mixed
workload (many requests with different policies and budgets, slow rows joining and leaving) sees
a new shape at nearly every slow step (capturing each one made engine steps of about 0.3 s in
the H200 quality runs). A
benchmark with one stable shape captures it at its third slow step. Without CUDA (tests on the
CPU, Triton's interpreter) the same body always runs eagerly.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from sfi_vllm.host_copy import copy_to_device
from sfi_vllm.selector import Selector, select_batched_static, top_k_positions

logger = logging.getLogger("sfi_vllm")

def top_k_function(kind: str, page_size: int = 0):
    """``sfi.experimental.selector_top_k``: the top-K after the fused Selector. ``torch``: the
    reference (:func:`sfi_vllm.selector.top_k_positions`, which hands page scores to
    :func:`sfi_vllm.selector.top_k_pages`); ``triton``: the Triton kernels
    (``sfi_vllm.kernels.top_k_pages`` for page selection, ``page_size > 1``, and
    ``sfi_vllm.kernels.top_k`` for token-level selection); ``auto``: the page kernel for page
    selection and torch's for token-level selection (the token kernel is slower than torch at
    wide frames). The page kernel takes page sizes that are powers of two up to 32; a request's
    other page size (2-256 are allowed) takes torch's whatever the kind."""
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"experimental.selector_top_k: unknown kind {kind!r}")
    if page_size > 1:
        from sfi_vllm.kernels.top_k_pages import supports, top_k_pages

        return top_k_pages if kind != "torch" and supports(page_size) else top_k_positions
    if kind == "triton":
        from sfi_vllm.kernels.top_k import top_k_positions as kernel

        return kernel
    return top_k_positions


# read at each use: the kernel tests lower it for Triton's interpreter (tests/kernels/conftest.py)
WIDTH_BUCKET = 2048
MAX_GRAPHS = 4
CAPTURE_AFTER = 3
MAX_COUNTED_SHAPES = 256
# The fused selector kernels serve frames up to this width; longer frames use the torch Selector.
# Fused against torch on the H200 (one slow step's selection work per layer, benchmarks/attn_timing.py):
# 1,168 vs 2,069 us at 6 x 128K, 563 vs 681 at 1 x 128K, 637 vs 953 at 8 x 32K, 596 vs 682 at
# 1 x 32K, with the kernel tests (tests/kernels) passing at a 128K frame. The bound only guards frames beyond
# the measured range.
FUSED_MAX_FRAME = 262144


@dataclass
class _Entry:
    logits: torch.Tensor  # (R, Hkv, G, W) float32, static input
    norms: torch.Tensor  # (R, Hkv, W) float32, static input
    counts: torch.Tensor  # (R,) float32: candidates per row
    budgets: torch.Tensor  # (R,) int64: K per row
    positions: torch.Tensor | None = None  # (R, Hkv, kmax) int64, static output
    loaded: tuple | None = None  # the counts and budgets last copied in
    graph: Any = None


class SlowStepSelection:
    def __init__(self, max_graphs: int = MAX_GRAPHS, fused_max_frame: int = FUSED_MAX_FRAME,
                 capture_after: int = CAPTURE_AFTER, top_k: str = "auto") -> None:
        self.max_graphs = max_graphs
        self.top_k_kind = top_k  # sfi.experimental.selector_top_k
        top_k_function(top_k)  # validates the kind
        self.fused_max_frame = fused_max_frame
        self.capture_after = capture_after
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        # per shape: (steps that used it, the last such step); newest MAX_COUNTED_SHAPES. A shape
        # that is evicted is forgotten, so one that keeps being evicted by others stays eager
        self._uses: OrderedDict[tuple, tuple[int, int | None]] = OrderedDict()
        self.captures = 0
        self.replays = 0  # replays of a graph captured at an earlier use
        self.eager_runs = 0

    def count_use(self, key: tuple, step: int | None = None) -> bool:
        """Record one use of a shape; True once it has been used in ``capture_after`` steps. The
        layers of one step (same ``step``) count once: a shape seen in a single step, which a
        mixed workload produces at nearly every slow step, is not captured."""
        n, last = self._uses.pop(key, (0, None))
        if step is None or step != last:
            n += 1
        self._uses[key] = (n, step)
        while len(self._uses) > MAX_COUNTED_SHAPES:
            self._uses.popitem(last=False)
        return n >= self.capture_after

    def forget(self, key: tuple) -> None:
        """An evicted shape starts counting again (so that shapes which keep evicting each other
        run eagerly instead of being captured again at every use)."""
        self._uses.pop(key, None)

    @staticmethod
    def frame_width(max_context: int) -> int:
        return -(-max_context // WIDTH_BUCKET) * WIDTH_BUCKET

    def select(self, selector: Selector, q: torch.Tensor, key_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, contexts: list[int], lo: int,
               hi: list[int], k: list[int], scale: float, step: int | None = None) -> torch.Tensor:
        """Positions ``(R, Hkv, max(k))`` (row ``b``'s first ``k[b]`` ascending) for the slow rows
        whose queries are ``q (R, Hq, D)``; see :func:`sfi_vllm.selector.select_batched`.
        ``step``: the engine step (the layers of a step count as one use of the shape)."""
        from sfi_vllm.kernels.selector_scores import selector_scores
        from sfi_vllm.kernels.slow_scores import slow_step_scores

        assert min(k) > 0 and all(kk <= h - lo for kk, h in zip(k, hi))
        rows, hq, _ = q.shape
        hkv = key_cache.shape[2]
        width = self.frame_width(max(contexts))
        kmax = max(k)
        key = (rows, hkv, hq // hkv, width, kmax, lo, selector.cfg, q.device)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key)
        self._entries.move_to_end(key)
        slow_step_scores(q, key_cache, block_table, seq_lens, width, scale, out=(entry.logits, entry.norms))
        loaded = (tuple(h - lo for h in hi), tuple(k))
        if entry.loaded != loaded:  # the layers of a step share them: copied once per step
            copy_to_device(entry.counts, torch.tensor(loaded[0], dtype=torch.float32))
            copy_to_device(entry.budgets, torch.tensor(loaded[1], dtype=torch.long))
            entry.loaded = loaded

        def body() -> torch.Tensor:
            if selector.cfg.smooth_kernel <= 1 and width <= self.fused_max_frame:  # fused kernels
                scores = selector_scores(selector.cfg, entry.logits, entry.norms, lo, entry.counts)
                top_k = top_k_function(self.top_k_kind, selector.cfg.page_size)
                return top_k(scores, lo, entry.budgets, kmax)
            # evidence smoothing or a frame past the bound: the torch Selector
            probs = torch.softmax(entry.logits, dim=-1)
            return select_batched_static(selector, probs, entry.norms, lo, entry.counts, entry.budgets, kmax)

        if q.device.type != "cuda":
            return body()
        if entry.graph is None:
            if not self.count_use(key, step):
                self.eager_runs += 1
                return body()
            self._capture(entry, body)
        else:
            self.replays += 1
        entry.graph.replay()
        assert entry.positions is not None
        return entry.positions

    def _new_entry(self, key: tuple) -> _Entry:
        rows, hkv, g, width, _, _, _, device = key
        while len(self._entries) >= self.max_graphs:
            old_key, old = self._entries.popitem(last=False)
            self.forget(old_key)
            if old.graph is not None:
                # a graph's pool returns to the allocator when the graph goes, without waiting for
                # a replay still running on this (the refresh) stream
                torch.cuda.current_stream().synchronize()
        z = dict(dtype=torch.float32, device=device)
        entry = _Entry(logits=torch.empty(rows, hkv, g, width, **z), norms=torch.empty(rows, hkv, width, **z),
                       counts=torch.empty(rows, **z), budgets=torch.empty(rows, dtype=torch.long, device=device))
        self._entries[key] = entry
        return entry

    def _capture(self, entry: _Entry, body) -> None:
        t0 = time.perf_counter()
        entry.graph, entry.positions = capture_graph(body)
        self.captures += 1
        rows, _, _, width = entry.logits.shape
        log_capture("the per-layer selection's", self.captures, time.perf_counter() - t0,
                    f"{rows} slow rows, a {width}-token frame")


CAPTURE_LOG_FIRST = 20  # captures logged one by one; after them every CAPTURE_LOG_EVERY-th
CAPTURE_LOG_EVERY = 100


def log_capture(what: str, captures: int, seconds: float, shape: str) -> bool:
    """Log a selection graph's capture made while serving (a pause of the engine: the capture
    synchronises the device): the first ``CAPTURE_LOG_FIRST`` of each kind, then every
    ``CAPTURE_LOG_EVERY``-th. ``captures``: this kind's count including this one. Returns whether
    it logged. The counts are also in ``sfi_cuda_graph_runs_total{how="capture"}``."""
    if captures > CAPTURE_LOG_FIRST and captures % CAPTURE_LOG_EVERY:
        return False
    logger.info("sfi-vllm: captured %s graph %d (%s) in %.0f ms; logged for the first %d and then every "
                "%d-th", what, captures, shape, seconds * 1e3, CAPTURE_LOG_FIRST, CAPTURE_LOG_EVERY)
    return True


def capture_graph(body, pool=None) -> tuple[Any, Any]:
    """``(graph, what body returned while captured)``. ``body`` runs once eagerly first, on a
    side stream (lazily initialised kernels and workspaces), then under capture (on a side stream
    too: CUDA captures no work of the default stream), in ``pool`` if given (a
    ``torch.cuda.graph_pool_handle()``); the warm-up's writes are those of the replay that follows.

    Python's cyclic garbage collector is off while capturing: a collection that frees an unreachable
    ``CUDAGraph`` (an old controller's cache, say) destroys it mid-capture, which CUDA forbids and which
    invalidates the capture (``cudaErrorStreamCaptureInvalidated``). torch no longer collects before a
    capture, and vLLM freezes the collector around its own captures for the same reason."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        body()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local", **({} if pool is None else {"pool": pool})):
            out = body()
    finally:
        if collecting:
            gc.enable()
    return graph, out
