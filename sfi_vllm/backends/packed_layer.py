"""PackedSFILayer: an attention layer's SFI work on the kernel path (Triton kernels, CUDA graphs).

The same method as :class:`~sfi_vllm.backends.common.SFILayer`, whose plain-torch code is the
specification, on preallocated compact buffers the Triton fast-step kernel reads
(:class:`~sfi_vllm.compact.PackedCompactBuffer`): slow rows are re-selected in batches (score
kernel, the Selector's fused kernels and top-K replayed from CUDA graphs, one repack launch), on
the executor's refresh stream or staged for the per-step refresh; fast rows run in one launch of
the fast-step kernel through tables made once per step; a *uniform* step (every row one decode
token) runs as one fixed-shape launch that a full CUDA graph captures. The shared device
resources belong to the engine's :class:`~sfi_vllm.backends.cuda_executor.CudaExecutor`.
"""

from __future__ import annotations

import torch

from sfi_vllm.backends.common import FastRows, SFILayer, SFIStep, _to_device, all_scored
from sfi_vllm.backends.cuda_executor import executor_for
from sfi_vllm.backends.step_refresh import refresh_per_step
from sfi_vllm.compact import PackedCompactBuffer
from sfi_vllm.controller import SFIController
from sfi_vllm.host_copy import rows_to_device, tensor_to_device
from sfi_vllm.paged_kv import PagedKV

# sfi.experimental.wide_dense_tiles: the fast-step kernel's wide tiles (kernels/fast_decode.py, "Wide
# tiles") for the dense rows of at least WIDE_DENSE_FROM keys, in uniform launches of at most
# WIDE_DENSE_MAX_ROWS rows. On the H200 (benchmarks/results/wide-tiles-h200.txt) 64-key tiles took
# 13-14% off dense rows at 128K and added 15-17% at 16K-32K; the fast rows of the same launch stayed
# within 3.3% at batches 1-8 and were 31% slower at 16 x 16K.
WIDE_DENSE_TILE = 64
WIDE_DENSE_FROM = 65536
WIDE_DENSE_MAX_ROWS = 8


class PackedSFILayer(SFILayer):
    """One layer's SFI state and work on the kernel path (see the module doc)."""

    def __init__(self, controller: SFIController, num_heads: int, num_kv_heads: int, head_size: int,
                 scale: float, packed: PackedCompactBuffer) -> None:
        super().__init__(controller, num_heads, num_kv_heads, head_size, scale, buffer=packed)
        self.packed = packed
        # the engine's shared device resources (refresh stream, selection graphs, per-step
        # refresh, fused scores)
        self.executor = executor_for(controller)
        # dense rows of at least this many keys take wide tiles in small uniform launches (0: never)
        self.wide_dense_from = WIDE_DENSE_FROM if controller.cfg.experimental.wide_dense_tiles else 0
        # uniform launches: split counts within one wave of programs (sfi.experimental.one_wave_splits)
        self.one_wave_splits = controller.cfg.experimental.one_wave_splits

    def refresh(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, layer_idx: int) -> None:
        """Re-select and repack the compact set of every slow row that refreshes this layer."""
        plan = step.plan
        rows = [r for r in step.slow_rows if self.refreshes(plan, r, layer_idx)]
        groups: dict = {}
        for r in rows:  # rows that share selector settings and sinks are scored together
            groups.setdefault((plan.configs[r].selector, step.geometry[r].sinks), []).append(r)
        if not groups:
            return
        dev = query.device
        # Inputs the refresh reads from vLLM's buffers are copied on this stream first: vLLM
        # may reuse the query's memory once this layer returns and rewrites the block table
        # before the next step. The rest runs on the refresh stream when there is one.
        jobs = []
        mode = self.controller.cfg.slow_refresh
        for (_, sinks), group in groups.items():
            key = ("refresh", tuple(group))
            if key not in step.layer_cache:  # once per step: the same for every layer
                step.layer_cache[key] = (_to_device([step.row_token[r] for r in group], dev),
                                         step.block_table[_to_device(group, dev)].to(torch.int32),
                                         refresh_per_step(mode, [step.seq_lens[r] for r in group],
                                                          all(plan.attends_set(r) for r in group))
                                         and all_scored(plan, step, group, sinks))
            tok, bt, deferred = step.layer_cache[key]
            if deferred:  # staged now, selected with every other layer when the step ends
                self.executor.step_refresh.record(step, self, paged, query, group, tok, bt, sinks,
                                                  len(self.controller.buffers))
            else:
                jobs.append((group, query[tok], bt))
        if not jobs:
            return
        side = self.executor.fork_refresh(dev)
        if side is None:
            with self.executor.timed(dev, 1):
                for group, q_rows, bt in jobs:
                    self._refresh_packed(step, paged, q_rows, bt, group)
            return
        with torch.cuda.stream(side), self.executor.timed(dev, 1):
            for group, q_rows, bt in jobs:
                q_rows.record_stream(side)  # allocated on the current stream, used on the side
                bt.record_stream(side)
                self._refresh_packed(step, paged, q_rows, bt, group)

    def _refresh_packed(self, step: SFIStep, paged: PagedKV, q_rows: torch.Tensor, bt: torch.Tensor,
                        rows: list[int]) -> None:
        """Slow rows of one selector setting, batched (``q_rows (R, Hq, D)`` and ``bt (R, .)``
        int32: their queries and block-table rows): scores from the Triton score kernel, the
        Selector's fused kernels + top-K (replayed from a CUDA graph:
        :class:`sfi_vllm.backends.selection.SlowStepSelection`), one repack launch."""
        plan, buf = step.plan, self.packed
        assert buf is not None
        cfg0 = plan.configs[rows[0]]
        ctx = [step.seq_lens[r] for r in rows]
        ws = [step.geometry[r].window_start for r in rows]
        sinks = step.geometry[rows[0]].sinks
        k = [step.geometry[r].selected for r in rows]
        dev = q_rows.device
        hkv = self.num_kv_heads
        kmax = max(k)
        scored = [i for i, r in enumerate(rows) if 0 < k[i] < ws[i] - sinks]
        key = ("positions", tuple(rows), sinks)
        if key not in step.layer_cache:
            # Per step, shared by the layers (written and read in stream order): sinks and the
            # rows whose candidates all fit are the same in every layer; the scored rows'
            # selections are overwritten by each layer.
            positions = torch.empty(len(rows), hkv, sinks + kmax, dtype=torch.long, device=dev)
            positions[..., :sinks] = torch.arange(sinks, device=dev)
            for i in range(len(rows)):
                if i not in scored and k[i] > 0:  # nothing to select, or every candidate fits
                    positions[i, :, sinks:sinks + k[i]] = torch.arange(sinks, sinks + k[i], device=dev)
            step.layer_cache[key] = (positions,
                                     _to_device(scored, dev) if 0 < len(scored) < len(rows) else None,
                                     tensor_to_device([ctx[i] for i in scored], dev, torch.int32) if scored else None)
        positions, sub, seq = step.layer_cache[key]
        if scored:
            key_cache, _ = paged.nhd_views()
            all_scored = sub is None
            sel = self.executor.slow_selection.select(
                self.selector(cfg0), q_rows if all_scored else q_rows[sub], key_cache,
                bt if all_scored else bt[sub], seq,
                [ctx[i] for i in scored], sinks, [ws[i] for i in scored], [k[i] for i in scored], self.scale,
                step=self.controller.planned_steps)
            if all_scored:
                positions[:, :, sinks:sinks + sel.shape[-1]] = sel
            else:
                positions[sub, :, sinks:sinks + sel.shape[-1]] = sel
        buf.pack_rows([plan.slots[r] for r in rows], [plan.generations[r] for r in rows], paged, bt,
                      positions, [sinks + kk for kk in k], ws, cache=step.layer_cache)

    def fast(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, output: torch.Tensor) -> None:
        """Fast rows: compact set + recent window, one softmax; writes ``output`` rows."""
        plan = step.plan
        split = step.layer_cache.get("fast_split")
        if split is None:  # once per step: the same for every layer
            split = step.layer_cache["fast_split"] = (
                [r for r in step.fast_rows if plan.configs[r].policy != "quest"],
                [r for r in step.fast_rows if plan.configs[r].policy == "quest"])
        kernel_rows, rows = split
        self._fast_packed(step, paged, query, output, kernel_rows)
        if rows and self.head_size & (self.head_size - 1) == 0:
            groups: dict = {}
            for r in rows:  # rows of one page size and sink count are selected together
                cfg = plan.configs[r]
                if cfg.quest_page <= 128:
                    groups.setdefault((cfg.quest_page, step.geometry[r].sinks), []).append(r)
            for (page, sinks), group in groups.items():
                self._quest_packed(step, paged, query, output, group, page, sinks)
            done = {r for g in groups.values() for r in g}
            rows = [r for r in rows if r not in done]  # pages over 128 tokens: the reference
        self._fast_reference(step, paged, query, output, rows)

    def _quest_packed(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, output: torch.Tensor,
                      rows: list[int], page: int, sinks: int) -> None:
        """Quest-style rows of one page size and sink count, batched (the GPU kernel path of
        :meth:`_quest_set`): page scores in one launch (``sfi_vllm.kernels.quest_pages``), top
        pages per row and KV head, sinks + pages repacked into each row's compact set (published
        at once: the set serves this step only), then the fast-step kernel over set + window."""
        from sfi_vllm.kernels.fast_decode import default_num_splits, fast_decode_attention
        from sfi_vllm.kernels.quest_pages import quest_page_scores

        from sfi_vllm.selector import top_k_positions

        plan, buf = step.plan, self.packed
        assert buf is not None
        dev = query.device
        hkv = self.num_kv_heads
        ctx = [step.seq_lens[r] for r in rows]
        lo, n_pages, budget, ws = [], [], [], []
        for r in rows:
            g = step.geometry[r]
            w = g.window_start
            n = (w - sinks) // page  # whole pages between the sinks and the window
            k = min(n, g.budget // page)
            lo.append(w - n * page)  # pages end at the window; a remainder joins the window's left
            n_pages.append(n)
            budget.append(k)
            ws.append(w - n * page if k == n else w)
        kmax = max(budget)
        positions = torch.zeros(len(rows), hkv, sinks + kmax * page, dtype=torch.int32, device=dev)
        positions[..., :sinks] = torch.arange(sinks, device=dev, dtype=torch.int32)
        tok_idx = _to_device([step.row_token[r] for r in rows], dev)
        row_idx = _to_device(rows, dev)
        bt = step.block_table[row_idx].to(torch.int32)
        scored = [i for i in range(len(rows)) if 0 < budget[i] < n_pages[i]]
        if scored:
            sub = _to_device(scored, dev)
            meta = rows_to_device([[lo[i] for i in scored], [n_pages[i] for i in scored]], dev)  # rows aligned
            key_cache, _ = paged.nhd_views()
            scores = quest_page_scores(query[tok_idx[sub]], key_cache, bt[sub], meta[0], meta[1], page,
                                       max(n_pages[i] for i in scored))
            k_dev = tensor_to_device([budget[i] for i in scored], dev)
            kk = max(budget[i] for i in scored)
            top = top_k_positions(scores, 0, k_dev, kk)  # (S, Hkv, kk) page indices, ascending
            tok = meta[0].long()[:, None, None, None] + top[..., None] * page + torch.arange(page, device=dev)
            positions[sub, :, sinks:sinks + kk * page] = tok.flatten(2).to(torch.int32)
        # rows with every page in budget take them through the window (ws = lo), none: sinks only
        counts = [sinks + (budget[i] * page if i in scored else 0) for i in range(len(rows))]
        buf.pack_rows([plan.slots[r] for r in rows], [plan.generations[r] for r in rows], paged, bt,
                      positions, counts, ws)
        host = rows_to_device([[plan.slots[r] for r in rows], ctx], dev)  # rows 16-byte aligned
        key_cache, value_cache = paged.nhd_views()
        max_keys = max(n + c - w for n, c, w in zip(counts, ctx, ws))
        out = fast_decode_attention(
            query[tok_idx], buf.keys, buf.values, key_cache, value_cache, bt, host[0],
            torch.zeros_like(host[0]), host[1], buf.length_dev, buf.window_start_dev, self.scale,
            default_num_splits(len(rows), hkv, max_keys), slot_map=buf.slot_map_dev)
        output[tok_idx] = out.to(output.dtype)
        for r, n, c, w in zip(rows, counts, ctx, ws):
            self.controller.stats.record_fast_layer(plan.req_ids[r], n + c - w, c)

    def _fast_packed(self, step: SFIStep, paged: PagedKV, query: torch.Tensor,
                     output: torch.Tensor, rows: list[int]) -> None:
        """All ``rows`` in one launch of the Triton fast-step kernel (tables made once per step:
        one entry per query token, :func:`~sfi_vllm.backends.common.fast_entries`)."""
        if not rows:
            return
        from sfi_vllm.kernels.fast_decode import default_num_splits, fast_decode_attention

        plan, buf, tables = step.plan, self.packed, step.fast_tables
        assert buf is not None and tables is not None and tables.rows >= len(rows)
        max_keys = step.layer_cache.get("fast_max_keys")
        if max_keys is None:
            # once per step, from the first layer's sets: a request's first selection publishes
            # every layer's set (so the check holds for all), and the key count only sizes the
            # launch (its split count; another layer's window may have grown a little further
            # under layer_interleaved_refresh, which the kernel handles at any split count)
            max_keys = 0
            for row in rows:
                slot = plan.slots[row]
                if not buf.valid(slot, plan.generations[row]):
                    raise RuntimeError(
                        f"sfi-vllm: fast step for request {plan.req_ids[row]} has no compact set "
                        "(a slow step must come first); this is a bug"
                    )
                max_keys = max(max_keys, buf.length[slot] + step.seq_lens[row] - buf.window_start[slot])
            step.layer_cache["fast_max_keys"] = max_keys
        key_cache, value_cache = paged.nhd_views()
        assert tables.token is not None
        out = fast_decode_attention(
            query[tables.token], buf.keys, buf.values, key_cache, value_cache, tables.block_table,
            tables.slot, tables.min_window_start, tables.seq_lens, buf.length_dev, buf.window_start_dev,
            self.scale, default_num_splits(tables.rows, self.num_kv_heads, max_keys), slot_map=buf.slot_map_dev)
        output[tables.token] = out.to(output.dtype)
        if tables.padding is not None:
            output[tables.padding] = 0

    def wide_tile(self, rows: int) -> int:
        """The key tile of long dense rows in a uniform launch of ``rows`` rows (CUDA-graph padding
        included; ``sfi.experimental.wide_dense_tiles``), 0: the launch takes no wide tiles."""
        return WIDE_DENSE_TILE if self.wide_dense_from and rows <= WIDE_DENSE_MAX_ROWS else 0

    def fast_uniform(self, tables: FastRows, paged: PagedKV, query: torch.Tensor,
                     output: torch.Tensor, workspace: torch.Tensor) -> None:
        """Every row one decode token (fast rows read their compact set, the others attend
        densely): one launch with fixed shapes that reads only device tables, so it can be
        captured in a full CUDA graph and replayed with the tables of later steps."""
        from sfi_vllm.kernels.fast_decode import (ScoreFrames, balanced_num_splits, fast_decode_attention,
                                                  uniform_num_splits)

        buf = self.packed
        assert buf is not None
        b = min(tables.rows, query.shape[0])
        if tables.splits is not None:  # balanced: each row its own count within a larger grid
            splits = balanced_num_splits(b, self.num_kv_heads)
        else:
            splits = uniform_num_splits(b, self.num_kv_heads, one_wave=self.one_wave_splits)
        wide = self.wide_tile(b)
        need = b * self.num_heads * splits * (self.head_size + 1)
        if need > workspace.numel():
            raise RuntimeError(f"sfi-vllm: fast-step workspace holds {workspace.numel()} floats, "
                               f"a batch of {b} rows needs {need}")
        acc = workspace[: b * self.num_heads * splits * self.head_size].view(
            b, self.num_heads, splits, self.head_size)
        lse = workspace[acc.numel(): need].view(b, self.num_heads, splits)
        key_cache, value_cache = paged.nhd_views()
        scores = None
        fused = self.executor.fused_scores
        if fused is not None and tables.scores is not None:
            if self.index >= fused.layers:
                raise RuntimeError(f"sfi-vllm: layer {self.index} has no fused score frames "
                                   f"(allocated for {fused.layers} layers); this is a bug")
            scores = ScoreFrames(*tables.scores, fused.logits, fused.norms, self.index)
        fast_decode_attention(
            query[:b], buf.keys, buf.values, key_cache, value_cache, tables.block_table,
            tables.slot, tables.min_window_start, tables.seq_lens, buf.length_dev, buf.window_start_dev,
            self.scale, splits, out=output[:b], workspace=(acc, lse), slot_map=buf.slot_map_dev,
            stage=self.stage, scores=scores, wide_block_n=wide, wide_from=self.wide_dense_from,
            row_splits=tables.splits)
