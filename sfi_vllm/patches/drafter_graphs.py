"""``sfi.drafter_graphs`` (on by default in sfi.mode lossless, CUDA): the drafter's one-token passes as
full CUDA graphs.

Why a patch: vLLM 0.26's speculative-decoding proposer gives a drafter piecewise CUDA graphs
only (``SpecDecodeBaseProposer.initialize_cudagraph_keys``), so each drafter pass runs its
attention eagerly, and the lossless mode's drafter passes are host-bound (about 10 ms of host
work per pass of a 36-layer model against about 4 ms of device work at 8 x 32K:
benchmarks/results/lossless-h200.md). The SFI attention of a one-token drafter pass is the lossy
mode's uniform launch, which reads device tables only. So the whole forward of passes 1..k-1 can
be one CUDA graph per batch size, and so can the first pass's where it holds one token per row
(``drafter_kv: shared``): it uses the same input buffers, so it replays the same graph, with its
re-selecting rows attending in the launch (``slow_in_graph``).

Patched (vLLM 0.26.0, V1 ``GPUModelRunner``'s proposer):

* ``SpecDecodeBaseProposer.propose``: counts its batch-execution decisions (the first is the first
  pass's, the second the one for passes 1..k-1) and lets the first pass's metadata build reach
  the proposer (``controller.first_pass_rows``): vLLM builds that pass's metadata before it
  decides, so the build asks vLLM's dispatcher for the padding itself (:func:`first_pass_graph_rows`);
* ``SpecDecodeBaseProposer._determine_batch_execution_and_padding``: returns ``CUDAGraphMode.FULL``
  for the later passes, and for the first pass when its build made the graph's tables (where vLLM
  chose piecewise graphs and runs no data parallelism), and wraps the proposer's model in
  :class:`DrafterGraphs` the first time.

Each pass's metadata build (``SFIBuilderMixin.build_for_drafting``) then writes the uniform tables
for every row of the padded batch at fixed addresses and reports it (``controller.draft_graph``);
:class:`DrafterGraphs` replays the graph captured for that batch size, captures it the first time
after one piecewise run of that size (an eager run and the capture on side streams, the garbage
collector off, in a private memory pool), and runs the pass piecewise when the build could not
serve it (a Quest-style row, a slow row that cannot run inside the graph, or buffers that moved
more than ``MAX_RECAPTURES`` times). A capture
happens in the middle of serving (a one-off pause per batch size, with a device synchronisation);
its memory is not in vLLM's KV-cache sizing. Not under tensor, pipeline or data parallelism
(logged at start-up: :func:`not_served`). The tokens stay the model's:
the model verifies every draft.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("sfi_vllm")

_INSTALLED = False
MAX_RECAPTURES = 2  # captures of one batch size again after a buffer moved, before it stays piecewise


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    output: Any
    addresses: tuple[int, ...]  # what the graph reads: inputs, and the tables' buffers


def _addresses(args, kwargs, tables: tuple[int, ...]) -> tuple[int, ...]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [v for _, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
    return tuple(t.data_ptr() for t in tensors) + tuple(tables)


class DrafterGraphs:
    """Wraps a drafter's model: passes that the proposer runs with ``CUDAGraphMode.FULL`` replay a
    captured graph per batch size (see the module doc); every other call runs the model."""

    def __init__(self, model, controller) -> None:
        self.runnable = model
        self.controller = controller
        self.graphs: dict[int, _Graph] = {}
        self.warmed: set[int] = set()  # batch sizes run once piecewise (Triton compiles outside a capture)
        self.failed: set[int] = set()  # batch sizes whose capture raised, or that moved too often: piecewise
        self.recaptures: dict[int, int] = {}
        self.pool = None
        self.captures = 0
        self.replays = 0
        self.piecewise = 0
        controller.drafter_graph_wrapper = self

    def counters(self) -> dict[str, int]:
        """The passes the proposer ran as full graphs since the wrapper was made, by how: replayed,
        captured, or piecewise ("eager": warm-up runs and passes the graph could not serve;
        sfi_cuda_graph_runs). The batch sizes left piecewise for good are in ``failed``."""
        return dict(replay=self.replays, capture=self.captures, eager=self.piecewise)

    def __getattr__(self, name: str):
        # the proposer reads the model's attributes (compute_logits, ...) through the wrapper
        if name in ("runnable", "controller", "graphs"):
            raise AttributeError(name)
        return getattr(self.runnable, name)

    def __call__(self, *args, **kwargs):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        fc = get_forward_context()
        if fc.cudagraph_runtime_mode != CUDAGraphMode.FULL:
            return self.runnable(*args, **kwargs)
        ready = self.controller.draft_graph
        rows = fc.batch_descriptor.num_tokens if fc.batch_descriptor is not None else None
        if ready is None or ready[0] != rows or rows in self.failed or rows not in self.warmed:
            # this pass's metadata does not serve a graph (eager rows, or a larger batch), or the
            # size runs once piecewise first: its kernels compile outside the capture
            if ready is not None and ready[0] == rows:
                self.warmed.add(rows)
            fc.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
            self.piecewise += 1
            return self.runnable(*args, **kwargs)
        addresses = _addresses(args, kwargs, ready[1])
        entry = self.graphs.get(rows)
        if entry is not None and entry.addresses != addresses:
            # a buffer the graph reads moved: capture again, but not every step
            self.recaptures[rows] = self.recaptures.get(rows, 0) + 1
            if self.recaptures[rows] > MAX_RECAPTURES:
                logger.warning("sfi-vllm: the drafter's buffers for %d rows keep moving; that batch size runs "
                               "in piecewise graphs", rows)
                self.graphs.pop(rows)
                self.failed.add(rows)
                fc.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
                self.piecewise += 1
                return self.runnable(*args, **kwargs)
            entry = None
        captured = entry is None
        if captured:
            try:
                entry = self.graphs[rows] = self._capture(fc, rows, addresses, args, kwargs)
            except Exception:  # noqa: BLE001 - any capture failure: this size runs piecewise
                logger.warning("sfi-vllm: capturing the drafter's pass for %d rows failed; that batch size "
                               "runs in piecewise graphs", rows, exc_info=True)
                self.graphs.pop(rows, None)
                self.failed.add(rows)
                fc.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
                self.piecewise += 1
                return self.runnable(*args, **kwargs)
        entry.graph.replay()
        self.replays += 0 if captured else 1  # the capturing pass counts as the capture
        return entry.output

    def _capture(self, fc, rows: int, addresses, args, kwargs) -> _Graph:
        """Capture the pass's forward for ``rows`` (the piecewise wrappers inside run their
        pieces directly: runtime mode NONE while capturing), with the selection graphs' capture:
        an eager run and the capture on side streams, the garbage collector off."""
        from vllm.config import CUDAGraphMode

        from sfi_vllm.backends.selection import capture_graph

        if self.pool is None or not self.graphs:
            # a pool whose graphs are all gone cannot take another capture: a new one
            self.pool = torch.cuda.graph_pool_handle()
        fc.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            graph, output = capture_graph(lambda: self.runnable(*args, **kwargs), pool=self.pool)
        finally:
            fc.cudagraph_runtime_mode = CUDAGraphMode.FULL
        self.captures += 1
        logger.info("sfi-vllm: captured the drafter's one-token passes for a batch of %d rows (captures %d, "
                    "replays so far %d, piecewise passes %d)", rows, self.captures, self.replays, self.piecewise)
        return _Graph(graph=graph, output=output, addresses=addresses)


def _breakable() -> bool:
    """vLLM's breakable CUDA graphs wrap the drafter's model themselves: not combined with these."""
    try:
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    except ImportError:
        return False
    return bool(is_breakable_cudagraph_enabled())


def _enabled(controller) -> bool:
    """Switched on, lossless, one GPU per engine (collectives inside the capture are not run
    through vLLM's graph_capture, which registers their buffers)."""
    cfg = controller.cfg
    parallel = getattr(controller.vllm_config, "parallel_config", None)
    single = (int(getattr(parallel, "tensor_parallel_size", 1) or 1) == 1
              and int(getattr(parallel, "pipeline_parallel_size", 1) or 1) == 1)
    return cfg.mode == "lossless" and cfg.drafter_graphs and single


def not_served(controller) -> str | None:
    """Why a lossless engine with ``drafter_graphs`` on will run its drafter's passes piecewise
    anyway (logged at start-up), or None."""
    parallel = getattr(controller.vllm_config, "parallel_config", None)
    if not _enabled(controller):
        return "tensor or pipeline parallelism (one GPU per engine only)"
    if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1:
        return "data parallelism"
    return None


def _serves(proposer, ctl) -> bool:
    """Inside a ``propose`` call of a ``draft_model`` proposer, with drafter graphs on."""
    return (getattr(proposer, "_sfi_decisions", None) is not None and ctl is not None and _enabled(ctl)
            and getattr(proposer, "method", None) == "draft_model")


def decide(proposer, ctl, mode, padded: int, across_dp):
    """The proposer's batch-execution decision, given vLLM's (``mode``, ``padded``, ``across_dp``):
    ``CUDAGraphMode.FULL`` where vLLM chose piecewise graphs, with no data parallelism or breakable
    graphs, for

    * the passes after the first of a ``propose`` call (its second decision), and
    * the first pass (its first decision) when its metadata build made the graph's tables for
      ``padded`` rows: one token per row (``drafter_kv: shared``), see :func:`first_pass_graph_rows`.
      vLLM builds the first pass's metadata before it decides, the later passes' after.

    The proposer's model is then wrapped in :class:`DrafterGraphs`."""
    from vllm.config import CUDAGraphMode

    if not _serves(proposer, ctl):
        return mode, padded, across_dp
    decisions = proposer._sfi_decisions
    proposer._sfi_decisions = decisions + 1
    if mode != CUDAGraphMode.PIECEWISE or across_dp is not None or _breakable():
        return mode, padded, across_dp
    first = decisions == 0 and ctl.draft_graph is not None and ctl.draft_graph[0] == padded
    if decisions == 1 or first:
        if not isinstance(proposer.model, DrafterGraphs):
            proposer.model = DrafterGraphs(proposer.model, ctl)
        if decisions == 1:
            ctl.draft_graph_rows = padded  # the builder writes tables for this many rows
        return CUDAGraphMode.FULL, padded, across_dp
    return mode, padded, across_dp


def first_pass_graph_rows(ctl, proposer, cam) -> int | None:
    """The padded batch of ``proposer``'s first pass run as a full CUDA graph, asked by its
    metadata build through ``ctl.first_pass_rows`` (the build comes before vLLM's decision for the
    pass): vLLM's padding for the pass when the pass holds one token per row and vLLM would run it
    in piecewise graphs; else None."""
    if not _serves(proposer, ctl) or proposer._sfi_decisions != 0 or _breakable():
        return None
    if int(cam.max_query_len) != 1 or int(cam.num_actual_tokens) != int(cam.num_reqs):
        return None
    parallel = getattr(ctl.vllm_config, "parallel_config", None)
    if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1:
        return None  # vLLM's decision would coordinate across ranks: not asked twice
    from vllm.config import CUDAGraphMode

    dispatcher = getattr(proposer, "cudagraph_dispatcher", None)
    if dispatcher is None:
        return None
    mode, batch = dispatcher.dispatch(int(cam.num_reqs))
    return int(batch.num_tokens) if mode == CUDAGraphMode.PIECEWISE else None


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from sfi_vllm.controller import current_controller

    orig_propose = SpecDecodeBaseProposer.propose
    orig_determine = SpecDecodeBaseProposer._determine_batch_execution_and_padding

    @functools.wraps(orig_propose)
    def propose(self, *args, **kwargs):
        self._sfi_decisions = 0  # the first decision is the first pass's, the second the later passes'
        ctl = current_controller()
        if ctl is not None:  # the first pass's metadata build asks for its padding
            ctl.first_pass_rows = functools.partial(first_pass_graph_rows, ctl, self)
        try:
            return orig_propose(self, *args, **kwargs)
        finally:
            self._sfi_decisions = None
            ctl = current_controller()
            if ctl is not None:
                ctl.draft_graph_rows = ctl.draft_graph = ctl.first_pass_rows = None

    @functools.wraps(orig_determine)
    def _determine_batch_execution_and_padding(self, num_tokens, use_cudagraphs=True):
        mode, padded, across_dp = orig_determine(self, num_tokens, use_cudagraphs)
        return decide(self, current_controller(), mode, padded, across_dp)

    SpecDecodeBaseProposer.propose = propose
    SpecDecodeBaseProposer._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
    _INSTALLED = True
