"""Repack: gather sinks + selected K/V from vLLM's paged cache into the compact buffer.

Reference: :meth:`sfi_vllm.paged_kv.PagedKV.gather` with per-head positions (what
:meth:`sfi_vllm.compact.CompactBuffer.pack` stores). Grid ``(rows, kv_heads, tiles)``; each program
copies ``BLOCK_N`` tokens x ``D`` of K and V for one (row, head): ``D``-contiguous loads from
the paged cache, contiguous stores into ``compact[slot, head]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _repack(KC, VC, BT, SLOT, POS, NPOS, CK, CV,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
            stride_pb, stride_ph, stride_cks, stride_ckh, stride_ckn,
            stride_cvs, stride_cvh, stride_cvn,
            D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < tl.load(NPOS + b)
    offs_d = tl.arange(0, D)
    pos = tl.load(POS + b * stride_pb + h * stride_ph + n, mask=nmask, other=0)
    blk = tl.load(BT + b * stride_btb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
    off = (pos % PAGE).to(tl.int64)
    slot = tl.load(SLOT + b).to(tl.int64)
    m2 = nmask[:, None]
    k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=m2)
    tl.store(CK + slot * stride_cks + h * stride_ckh + n[:, None] * stride_ckn + offs_d[None, :], k, mask=m2)
    v = tl.load(VC + blk[:, None] * stride_vb + off[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=m2)
    tl.store(CV + slot * stride_cvs + h * stride_cvh + n[:, None] * stride_cvn + offs_d[None, :], v, mask=m2)


def repack(key_cache, value_cache, block_table, slots, positions, num_positions, compact_k, compact_v,
           block_n: int = 64) -> None:
    """Copy ``positions (B, Hkv, C)`` (first ``num_positions[b]`` valid per row) into
    ``compact_k/v[slots[b], h, :num_positions[b]]``."""
    B, Hkv, C = positions.shape
    D = key_cache.shape[-1]
    _repack[(B, Hkv, triton.cdiv(C, block_n))](
        key_cache, value_cache, block_table, slots, positions, num_positions, compact_k, compact_v,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        positions.stride(0), positions.stride(1),
        compact_k.stride(0), compact_k.stride(1), compact_k.stride(2),
        compact_v.stride(0), compact_v.stride(1), compact_v.stride(2),
        D=D, PAGE=key_cache.shape[1], BLOCK_N=block_n,
    )
