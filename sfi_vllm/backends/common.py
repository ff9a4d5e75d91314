"""What the CPU and CUDA SFI backends share.

Per engine step (metadata builder, once for all layers): split the batch rows into *kernel rows*
(prefill, dense and slow decode rows, which the platform's dense kernel computes) and *fast rows*
(which read the compact set and the recent window), and build the dense kernel's metadata for the
kernel rows alone.

Per layer (impl): after the dense kernel ran, refresh the selection of slow rows (Selector over
the decode query's attention probabilities, then pack the compact set), and compute fast rows:
with the plain-torch reference (CPU, ``sfi.kernels=torch``), or on the GPU with the Triton
kernels (score kernel + batched Selector + one repack for slow rows, one fast-step launch for the
fast rows through tables made once per step: ``backends/packed_layer.py``). The GPU path also has
*uniform* steps (every row one decode token, none slow): one fixed-shape launch over all rows that
CUDA graphs capture (``PackedSFILayer.fast_uniform``; the CUDA builder decides, see
``backends/cuda.py``).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sfi_vllm.attention_ref import attention_probs, causal_attention_probs, fast_step_attention
from sfi_vllm.compact import CompactBuffer, PackedCompactBuffer, RowGeometry
from sfi_vllm.controller import SFIController, StepPlan
from sfi_vllm.host_copy import copy_to_device, rows_to_device, tensor_to_device, to_device
from sfi_vllm.paged_kv import PagedKV
from sfi_vllm.selector import Selector, candidate_page_mask, quest_page_bounds
from sfi_vllm.trigger import FIRST_SELECTION, StepMode

logger = logging.getLogger("sfi_vllm")

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class SFIStep:
    """One engine step's SFI view of the batch, shared by every layer."""

    plan: StepPlan
    row_token: list[int]  # the token index each row's SFI work reads (its first, or plan.query_tokens)
    seq_lens: list[int]  # tokens in the cache per row, including this step's
    # the plan's rows' RowGeometry at seq_lens: plan.geometry, or made from the metadata's
    # lengths for a plan without host context lengths
    geometry: list[RowGeometry]
    block_table: torch.Tensor  # (num_reqs, max_blocks)
    fast_rows: list[int]
    slow_rows: list[int]
    kernel_rows: list[int]
    kernel_token_idx: torch.Tensor | None  # token indices of the kernel rows (None: all tokens)
    kernel_metadata: Any = None  # the dense kernel's metadata for the kernel rows
    fast_tables: "FastRows | None" = None  # GPU path: the kernel's tables for the fast rows
    # GPU path: device tensors a slow step's layers share (index tensors, block-table rows,
    # lengths, position buffers), made by the first layer that needs them
    layer_cache: dict = field(default_factory=dict)
    # each row's token span [row_first, row_end) in the batch; a fast row attends for every token
    # from row_first to row_token (a drafter's first pass: its verified tokens; later tokens are
    # padding). None: one token per fast row, row_token
    row_first: list[int] | None = None
    row_end: list[int] | None = None
    # a drafter pass with drafter_kv shared: the tokens whose keys and values it writes
    # (plan.kv_write_tokens on the device); None: every token
    kv_write_idx: torch.Tensor | None = None


@dataclass
class FastRows:
    """Device tables for one launch of the fast-step kernel (``sfi_vllm.kernels.fast_decode``).

    Entry ``b`` reads query token ``token[b]`` (``None``: token ``b``), the compact set of slot
    ``slot[b]`` (``-1``: none, the entry attends densely) and the paged window from
    ``max(slot's window start, min_window_start[b])`` to ``seq_lens[b]``. An entry is a batch row,
    or one token of a row that attends for several (:func:`fast_entries`).
    """

    rows: int
    slot: torch.Tensor  # int32
    min_window_start: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32
    token: torch.Tensor | None = None
    # token indices whose output is zero: padding after a row's last real token (a drafter's first pass)
    padding: torch.Tensor | None = None
    # fused slow-step scores (uniform steps): per row frame base, layer stride and width (int32)
    scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # balanced splits (uniform steps, ``balanced_splits``): each row's split count
    splits: torch.Tensor | None = None


def subset_common_metadata(cam: Any, rows: list[int], seq_lens_host: list[int] | None = None) -> tuple[Any, torch.Tensor]:
    """``CommonAttentionMetadata`` restricted to ``rows`` (and their tokens); ``seq_lens_host``:
    every row's sequence length on the host (else read from the device: a sync)."""
    qsl = cam.query_start_loc_cpu.to(torch.long)
    dev = cam.query_start_loc.device
    lens = qsl[1:] - qsl[:-1]
    rows_t = torch.tensor(rows, dtype=torch.long)
    tok = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows])
    new_qsl = torch.zeros(len(rows) + 1, dtype=cam.query_start_loc_cpu.dtype)
    new_qsl[1:] = torch.cumsum(lens[rows_t], 0)
    rows_dev = to_device(rows_t, cam.seq_lens.device)
    tok_dev = to_device(tok, cam.slot_mapping.device)
    seq_lens = cam.seq_lens[rows_dev]
    max_seq = max(seq_lens_host[r] for r in rows) if seq_lens_host is not None else int(seq_lens.max())
    fields: dict[str, Any] = dict(
        query_start_loc=to_device(new_qsl, dev),
        query_start_loc_cpu=new_qsl,
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(tok.numel()),
        max_query_len=int(lens[rows_t].max()),
        max_seq_len=max_seq,
        block_table_tensor=cam.block_table_tensor[to_device(rows_t, cam.block_table_tensor.device)],
        slot_mapping=cam.slot_mapping[tok_dev],
    )
    if getattr(cam, "positions", None) is not None:
        fields["positions"] = cam.positions[to_device(tok, cam.positions.device)]
    for name in ("is_prefilling", "seq_lens_cpu_upper_bound", "_seq_lens_cpu", "_num_computed_tokens_cpu"):
        value = getattr(cam, name, None)
        if isinstance(value, torch.Tensor) and value.shape[:1] == cam.seq_lens.shape[:1]:
            fields[name] = value[to_device(rows_t, value.device)]
    for name in ("logits_indices_padded", "num_logits_indices", "_num_computed_tokens_cache",
                 "_token_to_req_indices_cache"):
        if hasattr(cam, name):
            fields[name] = None
    return cam.replace(**fields), tok


def make_step(
    plan: StepPlan, cam: Any, build_kernel_metadata: Callable[[Any], Any]
) -> SFIStep:
    n = cam.num_reqs
    if n < plan.num_reqs:
        raise RuntimeError(
            f"sfi-vllm: attention metadata has {n} rows but the step plan has {plan.num_reqs}; "
            "the runner hooks are out of step with this vLLM version"
        )
    modes = plan.modes + [int(StepMode.PREFILL)] * (n - plan.num_reqs)  # padding rows
    qsl = cam.query_start_loc_cpu.tolist()
    if plan.context is not None:  # host values: no device sync
        seq_lens = list(plan.context) + [0] * (n - plan.num_reqs)
    else:
        seq_lens = cam.seq_lens.tolist()
    geometry = plan.geometry
    if geometry is None:
        geometry = RowGeometry.many(plan.configs, seq_lens)
    # fast rows and keys-only slow rows attend to their compact sets; the others densely
    fast = [i for i in range(n) if i < plan.num_reqs and plan.attends_set(i)]
    slow = [i for i, m in enumerate(modes) if m == StepMode.SLOW]
    attends_set = set(fast)
    kernel = [i for i in range(n) if i not in attends_set]
    row_token = qsl[:-1]
    if plan.query_tokens is not None:  # rows whose query is not their first token
        row_token = list(plan.query_tokens) + row_token[plan.num_reqs:]
    step = SFIStep(
        plan=plan,
        row_token=row_token,
        seq_lens=seq_lens,
        geometry=geometry,
        block_table=cam.block_table_tensor,
        fast_rows=fast,
        slow_rows=slow,
        kernel_rows=kernel,
        kernel_token_idx=None,
        row_first=qsl[:-1],
        row_end=qsl[1:],
    )
    if plan.kv_write_tokens is not None:
        step.kv_write_idx = tensor_to_device(plan.kv_write_tokens, cam.slot_mapping.device)
    if fast and kernel:
        sub, tok = subset_common_metadata(cam, kernel, seq_lens)
        step.kernel_metadata = build_kernel_metadata(sub)
        step.kernel_token_idx = to_device(tok, cam.slot_mapping.device)  # once per step
    return step


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index tensor on ``device`` without a host wait (:mod:`sfi_vllm.host_copy`)."""
    return tensor_to_device(values, device)


def fast_row_tables(plan: StepPlan | None, rows: list[int]) -> torch.Tensor:
    """``(2, len(rows))`` int32 host table of the fast-step kernel: the compact-buffer slot of each
    row (``-1``: no compact set, the row attends densely) and the earliest window start."""
    out = torch.zeros(2, len(rows), dtype=torch.int32)
    out[0] = -1
    if plan is None:
        return out
    assert plan.geometry is not None, "the controller's plans carry host context lengths"
    for j, i in enumerate(rows):
        if i >= plan.num_reqs or not plan.attends_set(i) or plan.configs[i].policy == "quest":
            continue
        cfg = plan.configs[i]
        out[0, j] = plan.slots[i]
        if cfg.slides_window:
            out[1, j] = plan.geometry[i].window_start
    return out


def record_fast_rows(controller: SFIController, plan: StepPlan, rows: list[int],
                     buf: PackedCompactBuffer, contexts: list[int] | None = None) -> None:
    """Statistics of the fast rows of a GPU step, once per step from one layer's compact buffer
    (the kernel path does no per-layer host work). ``contexts``: each row's context when it is not
    the plan's (the earlier tokens of a multi-token row, :func:`fast_entries`)."""
    assert plan.context is not None and plan.geometry is not None
    for j, i in enumerate(rows):
        slot = plan.slots[i]
        ctx = plan.context[i] if contexts is None else contexts[j]
        ws = buf.window_start[slot]  # fixed at the slow step that packed the set
        if plan.configs[i].slides_window:
            g = plan.geometry[i] if ctx == plan.context[i] else RowGeometry.at(plan.configs[i], ctx)
            ws = max(ws, g.window_start)
        controller.stats.record_fast_layer(plan.req_ids[i], buf.length[slot] + ctx - ws, ctx)


def fast_entries(step: SFIStep, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The fast-step kernel's entries for ``rows``: per entry its row, query token and context.
    A row attends once per token from ``row_first`` to ``row_token`` (one token, except in a
    drafter's first pass over several verified tokens), each token seeing the compact set and the
    window up to itself (causal), as the reference does."""
    entry_rows, tokens, contexts = [], [], []
    for r in rows:
        t = step.row_token[r]
        first = t if step.row_first is None else step.row_first[r]
        for u in range(first, t + 1):
            entry_rows.append(r)
            tokens.append(u)
            contexts.append(step.seq_lens[r] - (t - u))
    return entry_rows, tokens, contexts


def uniform_table_rows(fused: bool, balanced: bool) -> int:
    """Rows of the persistent tables of :func:`uniform_tables`: slot and earliest window start,
    then the fused scores' frame base, layer stride and width (``fused``), then each row's split
    count (``balanced``)."""
    return 2 + 3 * fused + balanced


def row_keys(plan: StepPlan, scored: list[bool] | None = None) -> list[int]:
    """The keys each row of a uniform step reads in the fast-step kernel, from the host's plan:
    a row with a compact set its sinks, selected tokens and window at this step's geometry (the
    window may start a little earlier, where its set's slow step put it), plus half its context when
    ``scored`` (a keys-only slow row's score pass reads the keys without the values); any other row
    its whole context."""
    assert plan.context is not None and plan.geometry is not None
    out = []
    for i, ctx in enumerate(plan.context[:plan.num_reqs]):
        if plan.attends_set(i) and plan.configs[i].policy != "quest":
            g = plan.geometry[i]
            keys = g.sinks + g.selected + ctx - g.window_start
            out.append(keys + ctx // 2 if scored is not None and scored[i] else keys)
        else:
            out.append(ctx)
    return out


def balanced_split_table(plan: StepPlan | None, rows: int, width: int, kv_heads: int,
                         scored: list[bool] | None = None) -> torch.Tensor:
    """``(width,)`` int32 host table of each row's split count (``balanced_splits``,
    :func:`sfi_vllm.kernels.fast_decode.balanced_row_splits` over :func:`row_keys`); rows past
    ``rows`` (CUDA-graph padding) take 1. Without a plan's contexts every row takes the default
    count (:func:`~sfi_vllm.kernels.fast_decode.uniform_num_splits`). Where the launch's grid has
    one split (large batches) every row takes 1 without counting."""
    from sfi_vllm.kernels.fast_decode import balanced_num_splits, balanced_row_splits, uniform_num_splits

    out = torch.ones(width, dtype=torch.int32)
    if balanced_num_splits(rows, kv_heads) <= 1:
        return out
    if plan is None or plan.context is None:
        out[:rows] = uniform_num_splits(rows, kv_heads)
        return out
    work = (row_keys(plan, scored) + [0] * rows)[:rows]
    out[:rows] = torch.tensor(balanced_row_splits(work, kv_heads), dtype=torch.int32)
    return out


def uniform_tables(plan: StepPlan | None, cam: Any, persistent: torch.Tensor,
                   controller: SFIController, kv_heads: int = 0) -> FastRows:
    """Tables of a uniform step (every row one decode token) for all ``cam.num_reqs`` rows,
    written into ``persistent`` (:func:`uniform_table_rows` rows by ``max_rows``) so that a
    captured CUDA graph reads this step's: with fused scores their frames (``FastRows.scores``),
    with ``balanced_splits`` each row's split count for ``kv_heads`` KV heads
    (``FastRows.splits``, written at every step, so that a graph captured with them reads them)."""
    from sfi_vllm.backends.step_refresh import score_row_tables

    n = cam.num_reqs
    copy_to_device(persistent[:2, :n], fast_row_tables(plan, list(range(n))))
    balanced = controller.cfg.balanced_splits
    fused = persistent.shape[0] == uniform_table_rows(True, balanced)
    if persistent.shape[0] != uniform_table_rows(fused, balanced):
        raise RuntimeError(f"sfi-vllm: {persistent.shape[0]} persistent row tables, not the layout of "
                           f"balanced_splits={balanced}; this is a bug")
    scored = None
    if fused:
        # every row, the CUDA-graph padding past n included: a padding row keeping an earlier
        # step's frame base would write over this step's frames
        frames = score_row_tables(plan, persistent.shape[1])
        copy_to_device(persistent[2:5], frames)
        scored = (frames[0, :n] >= 0).tolist()
    splits = None
    if balanced:
        if kv_heads <= 0:
            raise RuntimeError("sfi-vllm: balanced splits need the layers' KV heads; this is a bug")
        splits = persistent[persistent.shape[0] - 1]
        copy_to_device(splits, balanced_split_table(plan, n, persistent.shape[1], kv_heads, scored))
    if plan is not None and controller.buffers:
        record_fast_rows(controller, plan, plan.rows(StepMode.FAST), controller.buffers[0])
    return FastRows(rows=n, slot=persistent[0], min_window_start=persistent[1],
                    seq_lens=cam.seq_lens, block_table=cam.block_table_tensor,
                    scores=(persistent[2], persistent[3], persistent[4]) if fused else None, splits=splits)


def attach_fast_tables(step: SFIStep, cam: Any, controller: SFIController) -> None:
    """Tables of an eager step's fast rows (Quest-style rows excluded), made once per step: one
    kernel entry per query token (:func:`fast_entries`), and the padding tokens after a row's
    last real token, whose output is zeroed."""
    plan = step.plan
    rows = [r for r in step.fast_rows if plan.configs[r].policy != "quest"]
    if not rows:
        return
    entry_rows, tokens, contexts = fast_entries(step, rows)
    per_row = dict(zip(rows, fast_row_tables(plan, rows).t().tolist()))
    slots, min_ws = [], []
    for r, ctx in zip(entry_rows, contexts):
        slot, ws = per_row[r]
        if slot >= 0 and ctx != step.seq_lens[r] and plan.configs[r].slides_window:
            ws = RowGeometry.at(plan.configs[r], ctx).window_start  # where the window was at that token
        slots.append(slot)
        min_ws.append(ws)
    dev = cam.seq_lens.device
    # each row 16-byte aligned: the fast-step kernel compiles one variant whatever the row count
    tables = rows_to_device([slots, min_ws, contexts, tokens], dev)
    idx = _to_device(entry_rows, dev)
    padding = [u for r in rows if step.row_end is not None
               for u in range(step.row_token[r] + 1, step.row_end[r])]
    step.fast_tables = FastRows(rows=len(entry_rows), slot=tables[0], min_window_start=tables[1],
                                seq_lens=tables[2], block_table=cam.block_table_tensor[idx].to(torch.int32),
                                token=tables[3].long(), padding=_to_device(padding, dev) if padding else None)
    # keys-only slow rows attend here too, but count as slow steps
    fast = [j for j, r in enumerate(entry_rows) if plan.modes[r] == StepMode.FAST]
    record_fast_rows(controller, plan, [entry_rows[j] for j in fast], controller.buffers[0],
                     [contexts[j] for j in fast])


def all_scored(plan: StepPlan, step: SFIStep, rows: list[int], sinks: int) -> bool:
    """Whether every row selects ``0 < K`` of more than ``K`` candidates (the Selector runs for
    all of them; the per-step refresh serves only such groups)."""
    for r in rows:
        g = step.geometry[r]
        if not 0 < g.selected < g.window_start - sinks:
            return False
    return True


def layer_index(layer: Any, fallback: int) -> int:
    m = _LAYER_INDEX.search(getattr(layer, "layer_name", "") or "")
    return int(m.group(1)) if m else fallback


class SFILayer:
    """The SFI state and work of one attention layer (held by the backend's impl), in plain torch:
    the reference path (CPU, ``kernels: torch``) and the specification of the kernel path
    (:class:`~sfi_vllm.backends.packed_layer.PackedSFILayer`).

    Each row follows its own config (``plan.configs``): the engine's, or its request's overrides.
    """

    def __init__(self, controller: SFIController, num_heads: int, num_kv_heads: int,
                 head_size: int, scale: float, buffer: CompactBuffer | PackedCompactBuffer | None = None) -> None:
        self.controller = controller
        self.buffer = buffer if buffer is not None else CompactBuffer()  # the plain-torch storage
        self.packed: PackedCompactBuffer | None = None  # the kernel path's storage (PackedSFILayer)
        self.executor = None  # the kernel path's shared device resources (PackedSFILayer)
        self.index = controller.register_buffer(self.buffer)
        controller.layers.append(self)
        # slow_in_graph: this layer's copy of every row's query, written by the uniform launch
        # (persistent: a captured graph holds its address); and the layer's KV views, noted at its
        # eager calls, for a refresh made after a step that ran as a graph
        self.stage: torch.Tensor | None = None
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self._selectors: dict = {}
        # sfi.experimental.prompt_window: per slot, (request id, the last queries of its prompt
        # (n, Hq, D) float32, the position after the last), kept until its first selection
        self.prompt_queries: dict[int, tuple[str, torch.Tensor, int]] = {}

    def selector(self, cfg) -> Selector:
        sel = self._selectors.get(cfg.selector)
        if sel is None:
            sel = self._selectors[cfg.selector] = Selector(cfg.selector)
        return sel

    @staticmethod
    def refreshes(plan: StepPlan, row: int, layer_idx: int) -> bool:
        if plan.refresh_all[row] or not plan.configs[row].layer_interleaved_refresh:
            return True
        return (layer_idx + plan.slow_counts[row]) % 2 == 0

    def keep_prompt_queries(self, step: SFIStep, query: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` queries of each prefill row's prompt so far (``query (T, Hq, D)``,
        this step's); a chunk that continues the kept tokens of the same request extends them."""
        plan = step.plan
        assert step.row_first is not None and step.row_end is not None
        for i in range(plan.num_reqs):
            if plan.modes[i] != StepMode.PREFILL:
                continue
            first, end = step.row_first[i], step.row_end[i]
            n = end - first
            if n <= 0:
                continue
            stop = step.seq_lens[i]  # this chunk holds positions stop - n .. stop - 1
            tail = query[end - min(window, n):end].float().clone()
            kept = self.prompt_queries.get(plan.slots[i])
            if kept is not None and kept[0] == plan.req_ids[i] and kept[2] == stop - n and n < window:
                tail = torch.cat([kept[1], tail])[-window:]
            self.prompt_queries[plan.slots[i]] = (plan.req_ids[i], tail, stop)

    def _prompt_window_probs(self, step: SFIStep, row: int, keys: torch.Tensor) -> torch.Tensor | None:
        """The kept prompt queries' attention over ``keys`` at row ``row``'s first selection (and
        forget them); None: not a first selection, or none kept."""
        plan = step.plan
        if not plan.configs[row].experimental.prompt_window or plan.reasons[row] not in FIRST_SELECTION:
            return None
        kept = self.prompt_queries.pop(plan.slots[row], None)
        if kept is None or kept[0] != plan.req_ids[row] or kept[2] > keys.shape[1]:
            return None
        return causal_attention_probs(kept[1], kept[2], keys, self.scale)

    def refresh(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, layer_idx: int) -> None:
        """Re-select and repack the compact set of every slow row that refreshes this layer."""
        plan = step.plan
        rows = [r for r in step.slow_rows if self.refreshes(plan, r, layer_idx)]
        t0 = time.perf_counter()  # the reference path runs synchronously on the host: timed
        for row in rows:
            cfg = plan.configs[row]
            ctx = step.seq_lens[row]
            bt = step.block_table[row]
            g = step.geometry[row]
            ws, sinks, k = g.window_start, g.sinks, g.selected
            if g.scored:
                keys, _ = paged.gather_range(bt, 0, ctx, want_values=False)
                q = query[step.row_token[row]].view(self.num_heads, self.head_size)
                probs = attention_probs(q, keys, self.scale)
                window_probs = self._prompt_window_probs(step, row, keys)
                if window_probs is not None:  # the prompt's last queries join the evidence
                    probs = torch.cat([probs, window_probs], dim=1)
                norms = keys[:, sinks:ws].float().norm(dim=-1)
                candidates = None
                if cfg.experimental.candidate_pages and cfg.selector.page_size > 1:
                    bounds = quest_page_bounds(q, keys, sinks, ws, cfg.selector.page_size, self.scale)
                    candidates = candidate_page_mask(bounds, k, cfg.experimental.candidate_pages, cfg.selector)
                selected = self.selector(cfg).select(probs, norms, sinks, ws, k, num_query_rows=1,
                                                     candidates=candidates)
            else:  # nothing to select, or every candidate fits: no need to score
                selected = torch.arange(sinks, sinks + k, device=bt.device).expand(self.num_kv_heads, -1)
            self.buffer.pack(plan.slots[row], plan.generations[row], paged, bt, sinks, selected, ws)
        if rows and query.device.type == "cpu":
            self.controller.stats.observe_selection(time.perf_counter() - t0)

    def fast(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, output: torch.Tensor) -> None:
        """Fast rows: compact set + recent window, one softmax; writes ``output`` rows."""
        self._fast_reference(step, paged, query, output, step.fast_rows)

    def _fast_reference(self, step: SFIStep, paged: PagedKV, query: torch.Tensor, output: torch.Tensor,
                        rows: list[int]) -> None:
        plan = step.plan
        for row in rows:
            cfg = plan.configs[row]
            ctx = step.seq_lens[row]
            bt = step.block_table[row]
            t = step.row_token[row]
            q = query[t].view(self.num_heads, self.head_size)
            if cfg.policy == "quest":
                ck, cv, ws = self._quest_set(q, paged, bt, step.geometry[row], cfg)
            else:
                entry = self.buffer.get(plan.slots[row], plan.generations[row])
                if entry is None:
                    raise RuntimeError(
                        f"sfi-vllm: fast step for request {plan.req_ids[row]} has no compact set "
                        "(a slow step must come first); this is a bug"
                    )
                ck, cv = entry.keys, entry.values
                ws = self._window_start(cfg, step.geometry[row], entry.window_start)
            first = t if step.row_first is None or cfg.policy == "quest" else step.row_first[row]
            # causal: token u of the row sees the compact set and the window up to itself
            for u in range(first, t + 1):
                ctx_u, ws_u = ctx - (t - u), ws
                if u < t and cfg.slides_window:  # a sliding window starts where it does at u
                    ws_u = self._window_start(cfg, RowGeometry.at(cfg, ctx_u), entry.window_start)
                wk, wv = paged.gather_range(bt, ws_u, ctx_u)
                qu = q if u == t else query[u].view(self.num_heads, self.head_size)
                out = fast_step_attention(qu, ck, cv, wk, wv, self.scale)
                output[u] = out.view_as(output[u]).to(output.dtype)
                if plan.modes[row] == StepMode.FAST:  # a keys-only slow row counts as a slow step
                    self.controller.stats.record_fast_layer(plan.req_ids[row], ck.shape[1] + (ctx_u - ws_u), ctx_u)
            if step.row_end is not None and step.row_end[row] > t + 1:
                output[t + 1: step.row_end[row]] = 0  # padding after the row's last real token

    @staticmethod
    def _window_start(cfg, geometry: RowGeometry, selected_at: int) -> int:
        """A fast row's window start: ``selected_at``, fixed at the slow step that packed its
        compact set, or with a sliding window the step's own (``geometry``) once that is later."""
        return max(selected_at, geometry.window_start) if cfg.slides_window else selected_at

    def _quest_set(self, q: torch.Tensor, paged: PagedKV, bt: torch.Tensor, geometry: RowGeometry, cfg):
        """Quest-style selection for one step: sinks + the pages whose key min/max bound q.k
        highest (per KV head, the max over its query heads), within ``K`` tokens."""
        ws = geometry.window_start
        sinks = geometry.sinks
        page = cfg.quest_page
        n_pages = (ws - sinks) // page  # whole pages between the sinks and the window
        budget_pages = min(n_pages, geometry.budget // page)
        lo = ws - n_pages * page  # pages end at the window; any remainder joins the window's left
        ws = lo if n_pages == budget_pages else ws
        pos = torch.arange(sinks, device=bt.device)
        if 0 < budget_pages < n_pages:
            keys, _ = paged.gather_range(bt, lo, ws, want_values=False)
            kp = keys.float().view(self.num_kv_heads, n_pages, page, self.head_size)
            kmin, kmax = kp.amin(dim=2), kp.amax(dim=2)  # (Hkv, P, D)
            qg = q.float().view(self.num_kv_heads, -1, self.head_size)  # (Hkv, G, D)
            bound = torch.maximum(qg[:, :, None, :] * kmin[:, None], qg[:, :, None, :] * kmax[:, None])
            score = bound.sum(-1).amax(dim=1)  # (Hkv, P)
            top = torch.topk(score, budget_pages, dim=-1).indices.sort(dim=-1).values
            tok = (lo + top[..., None] * page + torch.arange(page, device=bt.device)).flatten(1)
            positions = torch.cat([pos.expand(self.num_kv_heads, -1), tok], dim=1)
        else:
            positions = pos.expand(self.num_kv_heads, -1)
        ck, cv = paged.gather(bt, positions)
        return ck, cv, ws


def is_drafter_config(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` is a speculative drafter's (vLLM builds the drafter with its own
    model config: the speculative config's ``draft_model_config``)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "draft_model_config", None) is vllm_config.model_config


class SFIBackendMixin:
    """What both SFI backends declare on top of their platform backend."""

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ looks the name up in AttentionBackendEnum: it must be "CUSTOM".
        return "CUSTOM"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == "decoder"  # AttentionType.DECODER (a str enum), without importing vLLM here


KERNEL_HEAD_SIZES_TESTED = (64, 128)
_WARNED_HEAD_SIZES: set[int] = set()


def check_kernel_head_size(head_size: int) -> None:
    """The Triton kernels index a head with ``tl.arange(0, head_size)``, which needs a power of two;
    raise at start-up for any other size (a model with head size 80 or 96 would otherwise fail to
    compile at its first decode step), and warn outside the tested sizes."""
    if head_size < 16 or head_size & (head_size - 1):
        raise ValueError(
            f"sfi-vllm: the GPU kernels need a power-of-two head size of at least 16 (tested: "
            f"{', '.join(map(str, KERNEL_HEAD_SIZES_TESTED))}); this model's is {head_size}. "
            "`--additional-config '{\"sfi\": {\"kernels\": \"torch\"}}'` runs the torch reference "
            "path instead (any head size, not fast)")
    if head_size not in KERNEL_HEAD_SIZES_TESTED and head_size not in _WARNED_HEAD_SIZES:
        _WARNED_HEAD_SIZES.add(head_size)
        logger.warning("sfi-vllm: head size %d is a power of two but was not tested with the GPU kernels "
                       "(tested: %s)", head_size, KERNEL_HEAD_SIZES_TESTED)


def check_layer_supported(alibi_slopes, sliding_window, logits_soft_cap, sinks, attn_type,
                          decoder_type) -> None:
    """Raise for a layer SFI cannot serve (called by both impls before their platform init)."""
    from sfi_vllm.version import require_supported_vllm

    require_supported_vllm()
    problems = unsupported_features(alibi_slopes, sliding_window, logits_soft_cap, sinks,
                                    attn_type, decoder_type)
    if problems:
        raise ValueError(f"sfi-vllm cannot serve this model: {', '.join(problems)} not supported")


def unsupported_features(alibi_slopes, sliding_window, logits_soft_cap, sinks, attn_type,
                         decoder_type) -> list[str]:
    problems = []
    if alibi_slopes is not None:
        problems.append("ALiBi")
    if sliding_window is not None:
        problems.append("sliding-window attention")
    if logits_soft_cap:
        problems.append("logits soft-capping")
    if sinks is not None:
        problems.append("learned attention sinks")
    if attn_type != decoder_type:
        problems.append(f"attention type {attn_type}")
    return problems


class SFIBuilderMixin:
    """Mixed into a platform metadata builder: attach the step's SFI view to its metadata.

    ``metadata_cls`` is the platform metadata dataclass extended with an ``sfi`` field.
    """

    metadata_cls: type

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        from sfi_vllm.controller import get_controller

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[call-arg]
        self.controller = get_controller(vllm_config)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        # sfi.mode lossless: the model's own steps are the platform's dense attention (they verify
        # the drafts); SFI attends in the drafter's passes only
        if self.controller.lossless:
            return self._build(common_attn_metadata, fast_build, None, uniform=False)
        return self._build(common_attn_metadata, fast_build, self.controller.take_plan())

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        """A drafter pass (vLLM speculative decoding; sfi.mode lossless): planned from the model
        step's plan by :func:`sfi_vllm.lossless.plan_draft`. The previous pass's selections
        (staged for the per-step refresh, or made inside its CUDA graph) run first: this pass's
        fast rows read them."""
        plan = None
        ctl = self.controller
        executor = ctl.executor
        # a drafter whose layers fall into several attention groups builds each pass once per
        # group: only the first build of a pass runs what earlier passes staged (a later group's
        # would run this pass's own slow rows before its forward staged their queries)
        cached = ctl.draft_plans.get(draft_index)
        again = ctl.current_plan is not None and cached is not None and cached[0] is ctl.current_plan
        if executor is not None and executor.has_staged_work and not again:
            executor.finish(ctl.layers)
        ctl.draft_graph = None
        if ctl.lossless:
            from sfi_vllm.lossless import plan_draft

            plan = plan_draft(ctl, common_attn_metadata, draft_index)
        # the padded batch of a pass run as a full CUDA graph (sfi.drafter_graphs); a first pass
        # qualifies when it holds one token per row (the drafter_graphs patch answers)
        if draft_index > 0:
            graph_rows = ctl.draft_graph_rows
        else:
            graph_rows = ctl.first_pass_rows(common_attn_metadata) if ctl.first_pass_rows is not None else None
        return self._build(common_attn_metadata, True, plan, graph_rows=graph_rows)

    def _build(self, cam, fast_build: bool, plan: StepPlan | None, uniform: bool = True,
               graph_rows: int | None = None):
        from dataclasses import fields

        platform_build = super().build  # type: ignore[misc]
        base = platform_build(0, cam, fast_build)  # 0: no cascade attention with SFI
        meta = self.metadata_cls(**{f.name: getattr(base, f.name) for f in fields(base)})
        meta.sfi_planned = plan is not None
        # a pass that writes only some of its tokens (drafter_kv shared) is never a uniform one
        is_uniform = bool(uniform and (plan is None or plan.kv_write_tokens is None)
                          and self._build_uniform(meta, cam, plan, graph_rows))
        # the previous steps' refresh work (second stream) this step must see, before any of its
        # kernels (the builds above write nothing the refresh reads); a step that is not uniform runs
        # eagerly and waits for all of it (sfi.refresh_overlap lets only uniform steps run beside)
        if self.controller.executor is not None:
            self.controller.executor.join_refresh(plan if is_uniform else None, self.controller.planned_steps)
        if is_uniform:
            return meta
        if plan is not None:
            meta.sfi = make_step(plan, cam, lambda sub: platform_build(0, sub, fast_build))
            self._build_fast_tables(meta.sfi, cam)
        return meta

    def _build_uniform(self, meta, cam, plan: StepPlan | None, graph_rows: int | None = None) -> bool:
        """Platform hook: attach the all-rows fast-step tables of a step whose every row is one
        decode token served by the fast-step kernel (CUDA graphs); False: not such a step.
        ``graph_rows``: a drafter pass run as a full CUDA graph of that many (padded) rows
        (``sfi.drafter_graphs``)."""
        return False

    def _build_fast_tables(self, step: SFIStep, cam) -> None:
        """Platform hook: the fast rows' kernel tables of an eager step."""

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class SFIImplMixin:
    """Mixed into a platform attention impl: dense kernel for kernel rows, SFI for the rest."""

    _next_fallback_index = 0

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        from vllm.config import get_current_vllm_config

        from sfi_vllm.controller import get_controller

        check_layer_supported(alibi_slopes, sliding_window, logits_soft_cap, sinks, attn_type, "decoder")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,  # type: ignore[call-arg]
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        vllm_config = get_current_vllm_config()
        self.sfi_controller = get_controller(vllm_config)
        # sfi.mode lossless: SFI in the drafter's layers; the model's verify densely (no SFI state)
        self.sfi: SFILayer | None = None
        if not self.sfi_controller.lossless or is_drafter_config(vllm_config):
            self.sfi = self._make_layer(vllm_config, num_heads, num_kv_heads, head_size)
            self.sfi.stage = self._query_stage(vllm_config, num_heads, head_size)
        self._fallback_index = SFIImplMixin._next_fallback_index
        SFIImplMixin._next_fallback_index += 1

    def _make_layer(self, vllm_config, num_heads: int, num_kv_heads: int, head_size: int) -> SFILayer:
        """This layer's SFI state and work: the plain-torch reference; a platform with kernels
        returns its own (the CUDA impl: a PackedSFILayer)."""
        return SFILayer(self.sfi_controller, num_heads, num_kv_heads, head_size, float(self.scale))

    def _query_stage(self, vllm_config, num_heads: int, head_size: int) -> torch.Tensor | None:
        """``slow_in_graph``: the persistent buffer the uniform launch copies queries into."""
        return None

    def _write_drafter_kv(self, layer, key, value, kv_cache, index: torch.Tensor | None) -> None:
        """Write ``key`` and ``value`` (the tokens at ``index``; None: all) into the model's cache
        at the slots vLLM mapped for this drafter layer (sfi_vllm.patches.drafter_kv)."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        slots = get_attention_context(layer.layer_name)[3]
        if slots is None or key is None or value is None or not kv_cache.numel():
            return
        if index is not None:
            if not index.numel():
                return
            key, value, slots = key[index], value[index], slots[index]
        self.do_kv_cache_update(layer, key, value, kv_cache, slots)  # type: ignore[attr-defined]

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:  # per platform
        raise NotImplementedError

    def _workspace(self) -> torch.Tensor:  # platforms with a uniform fast path
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        dense = super().forward  # type: ignore[misc]
        if self.sfi is None:  # a verifying layer of sfi.mode lossless
            return dense(layer, query, key, value, kv_cache, attn_metadata, output,
                         output_scale, output_block_scale)
        if self.sfi.stage is not None and kv_cache.numel() and (
                self.sfi.kv is None or self.sfi.kv[0].data_ptr() != kv_cache.data_ptr()):
            self.sfi.kv = self._paged(kv_cache).nhd_views()  # the caches vLLM bound to this layer
        uniform = getattr(attn_metadata, "sfi_uniform", None)
        step = getattr(attn_metadata, "sfi", None)
        if getattr(layer, "_sfi_drafter_shared", False) and getattr(attn_metadata, "sfi_planned", False):
            # a drafter layer reading the model's cache (sfi.drafter_kv shared): vLLM skipped the
            # write; the pass writes only the tokens the model has not computed (a run without a
            # plan, profiling or warm-up, writes nothing: vLLM writes no shared layer's cache there)
            self._write_drafter_kv(layer, key, value, kv_cache, None if step is None else step.kv_write_idx)
        if uniform is not None:  # one decode token per row, all rows in one fixed-shape launch
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("sfi-vllm: fused output quantization is not supported")
            self.sfi.fast_uniform(uniform, self._paged(kv_cache), query.view(-1, self.num_heads, self.head_size),
                                  output.view(-1, self.num_heads, self.head_size), self._workspace())
            return output
        if step is None:  # profiling / warm-up / capture run: nothing planned, all rows dense
            return dense(layer, query, key, value, kv_cache, attn_metadata, output,
                         output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sfi-vllm: fused output quantization is not supported")
        if step.kernel_rows:
            if step.kernel_token_idx is None:
                dense(layer, query, key, value, kv_cache, attn_metadata, output)
            else:
                idx = step.kernel_token_idx
                sub_out = torch.empty((idx.numel(),) + tuple(output.shape[1:]),
                                      dtype=output.dtype, device=output.device)
                dense(layer, query[idx].contiguous(), key[idx].contiguous(),
                      value[idx].contiguous(), kv_cache, step.kernel_metadata, sub_out)
                output[idx] = sub_out
        window = self.sfi_controller.cfg.experimental.prompt_window
        if window and len(step.slow_rows) + len(step.fast_rows) < step.plan.num_reqs:  # prefill rows
            self.sfi.keep_prompt_queries(step, query.view(-1, self.num_heads, self.head_size), window)
        if step.slow_rows or step.fast_rows:
            q = query.view(-1, self.num_heads, self.head_size)
            out = output.view(-1, self.num_heads, self.head_size)
            paged = self._paged(kv_cache)
            li = layer_index(layer, self._fallback_index)
            # the fast rows first: a keys-only slow row attends through the set it had, which its
            # refresh then replaces
            self.sfi.fast(step, paged, q, out)
            self.sfi.refresh(step, paged, q, li)
        return output
