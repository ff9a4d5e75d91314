"""CompactBuffer: one layer's per-request working set of sinks + selected tokens.

At a slow step the Selector picks ``K`` positions per KV head among ``[sinks, window_start)``; the
sinks and those positions are gathered from the paged cache into one contiguous ``(Hkv, S + K, D)``
block per request, so fast steps read coalesced memory. The recent window ``[window_start, context)``
is not copied: fast steps read it in place from the paged cache. ``window_start`` is fixed at the
slow step (aligned down to ``window_align``), so tokens that arrive during the fast steps join the
window and nothing falls between the selected set and the window.

This is the plain-torch reference (entries allocated per request). The GPU path (issue 3) keeps
preallocated, double-buffered storage with the same contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfi_vllm.config import SFIConfig
from sfi_vllm.paged_kv import PagedKV


def window_start(cfg: SFIConfig, context_len: int) -> int:
    """First position of the recent window for a slow step at ``context_len`` tokens."""
    sinks = min(cfg.sinks, context_len)
    raw = context_len - cfg.recent_window
    if raw <= sinks:
        return sinks
    return max(sinks, (raw // cfg.window_align) * cfg.window_align)


def selected_count(cfg: SFIConfig, context_len: int) -> int:  # noqa: D401
    """K actually selected at a slow step: the budget, clipped to the number of candidates."""
    candidates = window_start(cfg, context_len) - min(cfg.sinks, context_len)
    return max(0, min(cfg.selected_budget(context_len), candidates))


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
