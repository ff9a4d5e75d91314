"""SFIFlashBackend: SFI on vLLM 0.26's FlashAttention backend (CUDA, FA3 on Hopper).

Two kinds of step:

* **Uniform steps** (every row one decode token, no row slow or Quest-style): all rows run the
  Triton fast-step kernel in one fixed-shape launch that reads device tables only (fast rows their
  compact set + paged window, other rows densely). The builder writes the tables into persistent
  buffers each step, so vLLM captures these steps in full CUDA graphs
  (``UNIFORM_SINGLE_TOKEN_DECODE``) and replays them with later steps' tables.
* **Eager steps** (prefill rows, slow rows, Quest rows): the runner hook steers them to vLLM's
  piecewise graphs (attention eager). FlashAttention runs the kernel rows (prefill, dense, slow);
  slow rows are then scored by the Triton score kernel, re-selected by the Selector (fused Triton
  kernels up to ``FUSED_MAX_FRAME`` tokens, torch ops beyond; top-K in torch; replayed from a CUDA graph per
  shape, :mod:`sfi_vllm.backends.selection`) and
  repacked in one launch; fast rows run the fast-step kernel; Quest-style rows get their pages
  from the page-bound kernel (``sfi_vllm.kernels.quest_pages``), repacked, then the fast-step kernel.

**Per-step refresh** (``sfi.slow_refresh``: ``per_step``, or ``auto`` for small enough slow rows):
instead of the above per layer, each layer stages its slow rows' queries and the whole step's
selection and repack run when the step ends, from one CUDA graph per shape
(:mod:`sfi_vllm.backends.step_refresh`). With ``sfi.slow_in_graph`` (on by default where it applies) such a step
can even run as a uniform step: its slow rows attend in the fast-step kernel (densely, or through
their sets when keys-only), which copies
every row's query into the layer's persistent stage, and the refresh is built from the plan.
With fused scores (``sfi.fused_scores_tokens``, on by default wherever ``slow_in_graph`` runs) that
kernel also writes the slow rows' logits and key norms
(:class:`sfi_vllm.backends.step_refresh.FusedScoreBuffers`, allocated with the first layer), and
the refresh skips the score kernel.

**Second stream** (``sfi.side_stream``, on by default): a slow row's selection and repack are
enqueued on a second CUDA stream after the layer's dense attention (the stream first waits for
everything enqueued so far), so they overlap with the next layers; the slow rows' queries and
block-table rows are copied on the main stream first (vLLM reuses those buffers). Repacks write
each slot's spare compact set and then publish it (``PackedCompactBuffer.slot_map_dev``, read by
the fast-step kernel), so a fast step reads the old or the new set, never a half-written one; the
metadata builder makes the main stream wait for the refresh stream before every step's kernels
(with ``sfi.refresh_overlap``, for the refreshes before the previous step only, whose sets a
commit then publishes: :mod:`sfi_vllm.backends.cuda_executor`; every layer's slot map and query
stage are then rows of one tensor each, so a commit and the refresh's copy of the stages are one
launch each).

With ``sfi.kernels="torch"`` the plain-torch reference serves fast and slow rows (no packed
buffers, no uniform path). Not done yet: GPU-side step planning. The step plan is made on the
host. With ``boundary_read = "exact"`` it reads the last sampled tokens (a device sync, which also
stalls vLLM's async scheduling) only at steps where some row's boundary check is due
(:class:`sfi_vllm.trigger.DeferredTokens`); with the default ``auto`` on a GPU (``lagged``) it
copies them to the host asynchronously and uses them one step later, so no step waits
(:class:`sfi_vllm.trigger.LaggedTokens`).

Compact-buffer memory, allocated per layer when the model is built (so vLLM's profiling counts it
before sizing the KV cache): ``2 (K, V) x sets x pool slots x kv_heads x (sinks + K_max) x
head_size x dtype bytes`` with ``sets`` 2 under the side stream (double buffering), else 1, and
the pool slots what ``compact_memory_gib`` holds (:mod:`sfi_vllm.compact_pool`); logged
at start-up, as is the uniform path's fp32 scratch (shared by the layers). Not
counted by the profiling: a slow step's selection buffers (fp32 logits of the slow rows over the
frame, and the selection graph's pool), allocated at the first slow step of each shape from the
memory vLLM leaves free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from sfi_vllm.backends.common import (
    check_kernel_head_size,
    FastRows,
    SFIBackendMixin,
    SFIBuilderMixin,
    SFIImplMixin,
    SFILayer,
    SFIStep,
    attach_fast_tables,
    uniform_table_rows,
    uniform_tables,
)
from sfi_vllm.backends.cuda_executor import executor_for
from sfi_vllm.backends.packed_layer import PackedSFILayer
from sfi_vllm.compact import PackedCompactBuffer
from sfi_vllm.paged_kv import PagedKV


logger = init_logger(__name__)


class SFIFlashBackend(SFIBackendMixin, FlashAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_impl_cls() -> type["SFIFlashImpl"]:
        return SFIFlashImpl

    @staticmethod
    def get_builder_cls() -> type["SFIFlashMetadataBuilder"]:
        return SFIFlashMetadataBuilder

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes


@dataclass
class SFIFlashMetadata(FlashAttentionMetadata):
    sfi: SFIStep | None = None
    sfi_uniform: FastRows | None = None
    sfi_planned: bool = False  # built for a planned step (not profiling, warm-up or capture)


class SFIFlashMetadataBuilder(SFIBuilderMixin, FlashAttentionMetadataBuilder):
    metadata_cls = SFIFlashMetadata
    # Uniform decode steps are captured whole; steps with slow rows are steered to piecewise
    # graphs by the runner hook (sfi_vllm.patches.runner_hooks). In sfi.mode lossless the model's
    # steps take FlashAttention's own graphs (get_cudagraph_support).
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        from sfi_vllm.config import config_from_vllm

        cfg = config_from_vllm(vllm_config)
        if cfg.mode == "lossless":
            # the model's steps are FlashAttention's alone (they verify), so its graphs serve them;
            # the drafter's passes, where SFI attends, get no full graphs from vLLM (its drafter
            # captures piecewise graphs only; sfi.drafter_graphs captures the one-token passes
            # itself). FlashAttention's class attribute, not this class's (which its
            # get_cudagraph_support would return)
            return FlashAttentionMetadataBuilder._cudagraph_support
        if cfg.kernels == "torch":
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._uniform_ok = self.controller.cfg.kernels != "torch"
        rows = max_uniform_rows(vllm_config)
        # persistent (captured) row tables: compact-buffer slot and earliest window start per row,
        # with fused scores (allocated by the layers, which are built before this) their frame
        # base, layer stride and width, and with balanced splits each row's split count
        executor = self.controller.executor
        tables = uniform_table_rows(executor is not None and executor.fused_scores is not None,
                                    self.controller.cfg.balanced_splits)
        self._row_tables = torch.zeros(tables, rows, dtype=torch.int32, device=device)
        self._kv_heads = int(kv_cache_spec.num_kv_heads)
        # sfi.drafter_graphs: the drafter's lengths at a fixed address (vLLM makes them anew
        # at every step's first drafter pass)
        cfg = self.controller.cfg
        self._graph_seq_lens = (torch.zeros(rows, dtype=torch.int32, device=device)
                                if cfg.mode == "lossless" and cfg.drafter_graphs else None)
        # ... and their block table when the padded batch has more rows than vLLM's holds
        self._graph_block_table: torch.Tensor | None = None

    def _build_uniform(self, meta, cam, plan, graph_rows: int | None = None) -> bool:
        if not self._uniform_ok or cam.max_query_len != 1 or (plan is not None and plan.needs_eager):
            return False
        n = cam.num_reqs
        if n > self._row_tables.shape[1]:
            return False  # larger than any CUDA-graph batch: the eager path serves it
        tables = uniform_tables(plan, cam, self._row_tables, self.controller, self._kv_heads)
        if graph_rows is not None and self._graph_seq_lens is not None:
            tables = self._graph_tables(tables, cam, graph_rows)
        meta.sfi_uniform = tables
        if plan is not None and plan.graph_slow:  # slow rows attend here, refreshed after the step
            self.controller.executor.note_graph_slow(plan, cam.block_table_tensor)
        return True

    def _graph_tables(self, tables: FastRows, cam, rows: int) -> FastRows:
        """A drafter pass run as a full CUDA graph of ``rows`` (padded) rows: tables for every row,
        the padding rows empty (no compact set, no keys), at addresses that do not move from step
        to step; reported in ``controller.draft_graph`` (the graph wrapper replays only then).

        The block table is vLLM's own where it holds ``rows`` rows. vLLM's holds ``max_num_seqs``
        rows, and the drafter's batch is padded to a multiple of ``num_speculative_tokens + 1``
        (8 rows to 10 with 4 draft tokens): past it the builder copies the table into one of its
        own (padding rows zero, read by no key since their lengths are zero)."""
        n = cam.num_reqs
        bt = cam.block_table_tensor
        if not n <= rows <= self._row_tables.shape[1]:
            return tables
        storage_rows = (bt.untyped_storage().nbytes() // bt.element_size() - bt.storage_offset()) // bt.stride(0)
        if rows <= storage_rows:
            block_table = bt.as_strided((rows, bt.shape[1]), bt.stride())
        else:
            own = self._graph_block_table  # as many rows as the row tables: its address stays
            if own is None or own.shape[1] != bt.shape[1] or own.device != bt.device:
                own = self._graph_block_table = torch.zeros(self._row_tables.shape[1], bt.shape[1], dtype=bt.dtype,
                                                            device=bt.device)
            own[:n].copy_(bt[:n])
            own[n:rows].zero_()
            block_table = own[:rows]
        self._graph_seq_lens[:n].copy_(cam.seq_lens[:n])
        self._graph_seq_lens[n:rows].zero_()
        self._row_tables[0, n:rows] = -1
        self._row_tables[1, n:rows] = 0
        self.controller.draft_graph = (rows, (self._graph_seq_lens.data_ptr(), block_table.data_ptr(),
                                              self._row_tables.data_ptr()))
        return FastRows(rows=rows, slot=tables.slot, min_window_start=tables.min_window_start,
                        seq_lens=self._graph_seq_lens, block_table=block_table, scores=tables.scores,
                        splits=tables.splits)

    def _build_fast_tables(self, step: SFIStep, cam) -> None:
        if self._uniform_ok:
            attach_fast_tables(step, cam, self.controller)


def max_uniform_rows(vllm_config) -> int:
    """Rows of the largest uniform decode batch (CUDA-graph padding included)."""
    rows = int(vllm_config.scheduler_config.max_num_seqs)
    capture = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
    return max(rows, int(capture or 0))


class SFIFlashImpl(SFIImplMixin, FlashAttentionImpl):
    def _make_layer(self, vllm_config, num_heads: int, num_kv_heads: int, head_size: int) -> SFILayer:
        packed = self._packed_buffer(vllm_config, num_kv_heads, head_size)
        if packed is None:  # kernels: torch
            return super()._make_layer(vllm_config, num_heads, num_kv_heads, head_size)
        return PackedSFILayer(self.sfi_controller, num_heads, num_kv_heads, head_size, float(self.scale), packed)

    def _packed_buffer(self, vllm_config, num_kv_heads: int, head_size: int) -> PackedCompactBuffer | None:
        from sfi_vllm.config import config_from_vllm
        from sfi_vllm.kernels.fast_decode import uniform_workspace_numel

        cfg = config_from_vllm(vllm_config)
        if cfg.kernels == "torch":
            return None
        check_kernel_head_size(head_size)
        ctl = self.sfi_controller
        executor = executor_for(ctl)
        if executor.fast_workspace is None:
            # one float32 scratch for the uniform fast path's partial outputs, shared by all layers
            # (they run one after another on one stream); allocated here so profiling counts it
            numel = uniform_workspace_numel(max_uniform_rows(vllm_config), self.num_heads, num_kv_heads, head_size,
                                            balanced=cfg.balanced_splits)
            executor.fast_workspace = torch.empty(numel, dtype=torch.float32,
                                                  device=torch.device("cuda", torch.cuda.current_device()))
            logger.info_once("sfi-vllm: fast-step workspace %.1f MiB", numel * 4 / 2**20)
        slots = ctl.compact_slots  # the pool (sfi_vllm.compact_pool), at most max_num_seqs
        capacity = cfg.compact_capacity(int(vllm_config.model_config.max_model_len))
        dtype = vllm_config.model_config.dtype
        sets = 2 if cfg.side_stream else 1  # double-buffered when refreshed on a second stream
        nbytes = PackedCompactBuffer.bytes_for(slots, num_kv_heads, capacity, head_size, dtype, cfg.side_stream)
        logger.info_once(
            "sfi-vllm: compact buffers take 2 (K, V) x %d sets x %d seqs x %d kv heads x %d tokens x %d x "
            "%d bytes = %.1f MiB per layer", sets, slots, num_kv_heads, capacity, head_size,
            torch.empty((), dtype=dtype).element_size(), nbytes / 2**20)
        device = torch.device("cuda", torch.cuda.current_device())
        return PackedCompactBuffer(slots, num_kv_heads, capacity, head_size, dtype, device,
                                   double_buffer=cfg.side_stream,
                                   slot_map_dev=self._live_map(vllm_config, executor, slots, device))

    def _live_map(self, vllm_config, executor, slots: int, device) -> torch.Tensor | None:
        """``sfi.refresh_overlap``: this layer's row of every layer's slot maps in one tensor, so
        that a commit updates them all in one launch (None: the buffer keeps a map of its own)."""
        if not executor.overlap:
            return None
        layers = int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        index = len(self.sfi_controller.buffers)  # the index this layer registers under
        if executor.live_maps is None:
            executor.live_maps = torch.zeros(layers, slots, dtype=torch.int32, device=device)
        maps = executor.live_maps
        return maps[index] if index < maps.shape[0] and maps.shape[1] == slots else None

    def _query_stage(self, vllm_config, num_heads: int, head_size: int) -> torch.Tensor | None:
        from sfi_vllm.config import config_from_vllm

        cfg = config_from_vllm(vllm_config)
        if cfg.kernels == "torch" or not cfg.graph_slow_enabled:
            return None
        rows = max_uniform_rows(vllm_config)
        dtype = vllm_config.model_config.dtype
        device = torch.device("cuda", torch.cuda.current_device())
        executor = executor_for(self.sfi_controller)
        stage = None
        if executor.overlap:  # every layer's stage in one tensor: a flush copies its rows in one launch
            layers = int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
            if executor.stages is None:
                executor.stages = torch.empty(layers, rows, num_heads, head_size, dtype=dtype, device=device)
            index = self.sfi.index
            if index < executor.stages.shape[0] and executor.stages.shape[1:] == (rows, num_heads, head_size):
                stage = executor.stages[index]
        if stage is None:
            stage = torch.empty(rows, num_heads, head_size, dtype=dtype, device=device)
        executor.graph_slow_ready = True
        logger.info_once("sfi-vllm: slow_in_graph query stage %d rows x %d heads x %d = %.1f MiB per layer",
                         rows, num_heads, head_size, stage.numel() * stage.element_size() / 2**20)
        if executor.fused_scores is None:
            self._allocate_fused_scores(vllm_config, cfg, num_heads)
        return stage

    def _allocate_fused_scores(self, vllm_config, cfg, num_heads: int) -> None:
        """Every layer's fused slow-step scores (``sfi.fused_scores_tokens``, resolved), allocated
        with the first layer (so vLLM's profiling counts them before it sizes the KV cache)."""
        from sfi_vllm.backends.step_refresh import FusedScoreBuffers

        layers = int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        kv_heads = self.num_kv_heads
        device = torch.device("cuda", torch.cuda.current_device())
        tokens = cfg.fused_tokens_for(layers, num_heads, kv_heads, int(vllm_config.scheduler_config.max_num_seqs),
                                      int(vllm_config.model_config.max_model_len),
                                      torch.cuda.get_device_properties(device).total_memory)
        if tokens == 0:
            return
        nbytes = FusedScoreBuffers.bytes_for(tokens, layers, num_heads, kv_heads)
        logger.info("sfi-vllm: fused slow-step scores take %d tokens x %d layers x (%d + %d heads) x 4 "
                    "bytes = %.1f MiB", tokens, layers, num_heads, kv_heads, nbytes / 2**20)
        executor_for(self.sfi_controller).fused_scores = FusedScoreBuffers.allocate(tokens, layers, num_heads, kv_heads, device)

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        return PagedKV(kv_cache, "flash", self.head_size)

    def _workspace(self) -> torch.Tensor:
        return self.sfi_controller.executor.fast_workspace
