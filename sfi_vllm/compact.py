"""CompactBuffer: one layer's per-request working set of sinks + selected tokens.

At a slow step the Selector picks ``K`` positions per KV head among ``[sinks, window_start)``; the
sinks and those positions are gathered from the paged cache into one contiguous ``(Hkv, S + K, D)``
block per request, so fast steps read coalesced memory. The recent window ``[window_start, context)``
is not copied: fast steps read it in place from the paged cache. ``window_start`` is fixed at the
slow step (aligned down to ``window_align``), so tokens that arrive during the fast steps join the
window and nothing falls between the selected set and the window.

This is the plain-torch reference (entries allocated per request). The GPU path keeps
preallocated, double-buffered storage with the same contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sfi_vllm.config import SFIConfig
from sfi_vllm.host_copy import rows_to_device
from sfi_vllm.paged_kv import PagedKV


def sink_count(cfg: SFIConfig, context_len: int) -> int:
    """Sinks a row at ``context_len`` tokens keeps: ``cfg.sinks``, or every token of a shorter
    context."""
    return min(cfg.sinks, context_len)


def window_start(cfg: SFIConfig, context_len: int) -> int:
    """First position of the recent window for a slow step at ``context_len`` tokens."""
    sinks = sink_count(cfg, context_len)
    raw = context_len - cfg.recent_window
    if raw <= sinks:
        return sinks
    return max(sinks, (raw // cfg.window_align) * cfg.window_align)


def selected_count(cfg: SFIConfig, context_len: int) -> int:  # noqa: D401
    """K actually selected at a slow step: the budget, clipped to the number of candidates."""
    return RowGeometry.at(cfg, context_len).selected


class RowGeometry(NamedTuple):
    """Where one row's tokens go at ``context`` tokens under its config: positions
    ``[0, sinks)`` are sinks, ``[sinks, window_start)`` the candidates a slow step selects
    ``selected`` of (``budget`` before clipping to the candidates), ``[window_start, context)``
    the recent window.

    :class:`~sfi_vllm.controller.StepPlan` holds one per row at the step's context, made once
    with the plan, and the step's layers, tables and refreshes read it rather than each applying
    the formulas above. A slow row is selected and packed at this geometry. A fast row's window
    need not start here: it starts where its compact set's slow step put it, and only a sliding
    window (``cfg.slides_window``) moves it up to this one; a Quest-style row whose candidate
    pages all fit its budget reads them as part of its window (``SFILayer._quest_set``).
    """

    context: int
    sinks: int
    window_start: int
    budget: int  # K for this context (cfg.selected_budget), before clipping to the candidates
    selected: int  # K the slow step selects: the budget clipped to [0, candidates]

    @classmethod
    def at(cls, cfg: SFIConfig, context_len: int) -> "RowGeometry":
        # made for every row of every step: a tuple (cheaper to build than a frozen dataclass)
        sinks = sink_count(cfg, context_len)
        ws = window_start(cfg, context_len)
        budget = cfg.selected_budget(context_len)
        return cls(context_len, sinks, ws, budget, max(0, min(budget, ws - sinks)))

    @classmethod
    def many(cls, configs, contexts) -> list["RowGeometry"]:
        """``RowGeometry.at`` of each (config, context) pair: the same formulas, with each config's
        constants read once (a step plan makes one per row, every step: at a batch of 128 rows this
        takes half the time of calling :meth:`at` per row)."""
        out = []
        consts: dict[int, tuple] = {}
        last = k = None
        for cfg, c in zip(configs, contexts):
            if cfg is not last:  # rows of one config are the common case
                k = consts.get(id(cfg))
                if k is None:  # K depends on the context only under selected_fraction
                    fixed = cfg.selected_budget(0) if cfg.policy == "streaming" or cfg.selected_fraction is None else None
                    k = consts[id(cfg)] = (cfg.sinks, cfg.recent_window, cfg.window_align, fixed)
                last = cfg
            sinks, window, align, budget = k
            if c < sinks:
                sinks = c
            raw = c - window
            ws = sinks if raw <= sinks else max(sinks, raw // align * align)
            if budget is None:
                budget = cfg.selected_budget(c)
            selected = min(budget, ws - sinks)
            out.append(cls(c, sinks, ws, budget, selected if selected > 0 else 0))
        return out

    @property
    def candidates(self) -> int:
        """Tokens between the sinks and the window, that a slow step selects from."""
        return self.window_start - self.sinks

    @property
    def scored(self) -> bool:
        """Whether a slow step runs the Selector: it keeps some but not all of the candidates (else
        it takes the first ``selected`` candidates, all or none, without scoring)."""
        return 0 < self.selected < self.candidates


@dataclass
class CompactEntry:
    generation: int
    keys: torch.Tensor  # (Hkv, S + K, D)
    values: torch.Tensor  # (Hkv, S + K, D)
    positions: torch.Tensor  # (Hkv, S + K), ascending per head
    window_start: int

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]


class CompactBuffer:
    """The compact sets of one attention layer, keyed by request slot."""

    def __init__(self) -> None:
        self._entries: dict[int, CompactEntry] = {}

    def pack(
        self,
        slot: int,
        generation: int,
        paged: PagedKV,
        block_table_row: torch.Tensor,
        num_sinks: int,
        selected: torch.Tensor,
        window_start: int,
    ) -> CompactEntry:
        """Gather sinks + ``selected (Hkv, K)`` positions into the slot's compact set."""
        hkv = paged.num_kv_heads
        sink_pos = torch.arange(num_sinks, device=selected.device).expand(hkv, num_sinks)
        positions = torch.cat([sink_pos, selected.to(sink_pos.dtype)], dim=1)
        keys, values = paged.gather(block_table_row, positions)
        assert values is not None
        entry = CompactEntry(generation, keys.contiguous(), values.contiguous(), positions, window_start)
        self._entries[slot] = entry
        return entry

    def get(self, slot: int, generation: int) -> CompactEntry | None:
        entry = self._entries.get(slot)
        if entry is None or entry.generation != generation:
            return None
        return entry

    def drop(self, slot: int) -> None:
        self._entries.pop(slot, None)

    def __len__(self) -> int:
        return len(self._entries)


class PackedCompactBuffer:
    """One layer's compact sets in preallocated storage (GPU path).

    Holds the same contents as :class:`CompactBuffer`; fast steps of a whole batch read it in one
    kernel launch (``sfi_vllm.kernels.fast_decode``), and slow steps fill it with the repack
    kernel. Allocated when the layer is built, so vLLM's memory profiling counts it before sizing
    the KV cache.

    **Double buffering** (``double_buffer=True``, used with the side stream): each slot owns two
    physical sets. A refresh repacks into the slot's spare set and then *publishes* it by writing
    the slot's entry of ``slot_map_dev`` (logical slot -> physical set, read by the fast-step
    kernel), in stream order after the repack. A fast step therefore reads either the old or the
    new set, each complete, never one being written. Each physical set's length and window start
    live on the device (``length_dev``, ``window_start_dev``: read by the kernel, also inside CUDA
    graphs); the published set's are mirrored on the host per logical slot (checks, statistics).
    With ``sfi.refresh_overlap`` a per-step refresh writes the spare set without publishing it, and
    a commit on the main stream updates ``slot_map_dev`` at a later step's start
    (:class:`sfi_vllm.backends.cuda_executor.Commit`); the host mirrors then run one step ahead of
    the device for the re-selected rows.
    """

    def __init__(self, num_slots: int, num_kv_heads: int, capacity: int, head_size: int,
                 dtype: torch.dtype, device: torch.device | str, double_buffer: bool = False,
                 slot_map_dev: torch.Tensor | None = None) -> None:
        self.sets_per_slot = 2 if double_buffer else 1
        physical = num_slots * self.sets_per_slot
        shape = (physical, num_kv_heads, capacity, head_size)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length_dev = torch.zeros(physical, dtype=torch.int32, device=device)
        self.window_start_dev = torch.zeros(physical, dtype=torch.int32, device=device)
        self.slot_map = [s * self.sets_per_slot for s in range(num_slots)]  # published set (host)
        # slot_map_dev: a view given by the caller (a row of every layer's maps in one tensor, so
        # that one launch updates them all: CudaExecutor.live_maps), or a tensor of its own
        initial = torch.tensor(self.slot_map, dtype=torch.int32)
        if slot_map_dev is None:
            self.slot_map_dev = initial.to(device)
        else:
            if slot_map_dev.shape != (num_slots,) or slot_map_dev.dtype != torch.int32:
                raise ValueError(f"slot_map_dev must be ({num_slots},) int32, not {tuple(slot_map_dev.shape)} "
                                 f"{slot_map_dev.dtype}")
            self.slot_map_dev = slot_map_dev
            self.slot_map_dev.copy_(initial)
        self.length = [0] * num_slots  # sinks + selected of the published set (host mirror)
        self.window_start = [0] * num_slots
        self.generation = [-1] * num_slots

    @staticmethod
    def bytes_for(num_slots: int, num_kv_heads: int, capacity: int, head_size: int,
                  dtype: torch.dtype, double_buffer: bool = False) -> int:
        sets = num_slots * (2 if double_buffer else 1)
        return 2 * sets * num_kv_heads * capacity * head_size * torch.empty((), dtype=dtype).element_size()

    def target(self, slot: int) -> int:
        """The physical set a refresh of ``slot`` writes: the spare one when double-buffered."""
        cur = self.slot_map[slot]
        if self.sets_per_slot == 1:
            return cur
        return slot * 2 + (1 - cur % 2)

    def published_keys(self, slot: int) -> torch.Tensor:
        """``(Hkv, length, D)`` keys of the set fast steps read for ``slot`` (tests, checks)."""
        return self.keys[self.slot_map[slot], :, : self.length[slot]]

    def pack(self, slot: int, generation: int, paged: PagedKV, block_table_row: torch.Tensor,
             num_sinks: int, selected: torch.Tensor, window_start: int) -> None:
        hkv = selected.shape[0]
        dev = self.keys.device
        sink_pos = torch.arange(num_sinks, device=dev, dtype=torch.int32).expand(hkv, num_sinks)
        positions = torch.cat([sink_pos, selected.to(dev, torch.int32)], dim=1)[None]
        self.pack_rows([slot], [generation], paged, block_table_row[None], positions,
                       [num_sinks + selected.shape[1]], [window_start])

    def pack_rows(self, slots: list[int], generations: list[int], paged: PagedKV,
                  block_tables: torch.Tensor, positions: torch.Tensor, counts: list[int],
                  window_starts: list[int], publish: bool = True, cache: dict | None = None) -> list[int]:
        """Repack several slots in one launch: ``positions (B, Hkv, C)`` (sinks first, then the
        selection, ascending), of which the first ``counts[b]`` are row ``b``'s. Writes each slot's
        :meth:`target` set and, with ``publish``, publishes it (:meth:`publish`). All device work
        is enqueued on the current stream. Returns the physical sets written. ``cache``: a dict
        shared by the layers of one step (the per-slot metadata tensor is made once per value)."""
        from sfi_vllm.kernels.repack import repack

        if max(counts) > self.capacity:
            raise RuntimeError(
                f"sfi-vllm: a compact set of {max(counts)} tokens exceeds the layer's capacity "
                f"{self.capacity} (sinks + the largest K the engine's SFI config allows)"
            )
        dev = self.keys.device
        targets = [self.target(s) for s in slots]
        key = ("pack_meta", tuple(targets), tuple(counts), tuple(window_starts), tuple(slots))
        meta = cache.get(key) if cache is not None else None
        if meta is None:
            meta = rows_to_device([targets, counts, window_starts, slots], dev)  # rows 16-byte aligned
            if cache is not None:
                cache[key] = meta
        key_cache, value_cache = paged.nhd_views()
        repack(key_cache, value_cache, block_tables.to(torch.int32), meta[0],
               positions.to(dev, torch.int32).contiguous(), meta[1], self.keys, self.values)
        phys = meta[0].long()
        self.length_dev[phys] = meta[1]
        self.window_start_dev[phys] = meta[2]
        if publish:
            self.publish(slots, generations, targets, counts, window_starts, meta[3].long(), meta[0])
        return targets

    def publish(self, slots: list[int], generations: list[int], targets: list[int], counts: list[int],
                window_starts: list[int], slots_dev: torch.Tensor, targets_dev: torch.Tensor) -> None:
        """Point ``slots`` at their freshly written sets ``targets`` (a device write, ordered
        after the repack on the current stream) and update the host mirrors."""
        self.slot_map_dev[slots_dev] = targets_dev
        self.publish_host(slots, generations, targets, counts, window_starts)

    def publish_host(self, slots: list[int], generations: list[int], targets: list[int], counts: list[int],
                     window_starts: list[int]) -> None:
        """The host half of :meth:`publish` (the device half written by whoever repacked: the
        ``slot_map_dev`` write above, or ``sfi_vllm.kernels.repack.repack_selected``)."""
        for slot, gen, t, n, ws in zip(slots, generations, targets, counts, window_starts):
            self.slot_map[slot] = t
            self.length[slot] = n
            self.window_start[slot] = ws
            self.generation[slot] = gen

    def valid(self, slot: int, generation: int) -> bool:
        return self.generation[slot] == generation

    def drop(self, slot: int) -> None:
        self.generation[slot] = -1
