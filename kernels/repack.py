"""Repack: gather sinks + selected K/V from vLLM's paged cache into the compact buffer.

Reference: :meth:`sfi_vllm.paged_kv.PagedKV.gather` with per-head positions (what
:meth:`sfi_vllm.compact.CompactBuffer.pack` stores). Grid ``(rows, kv_heads, tiles)``; each program
copies ``BLOCK_N`` tokens x ``D`` of K and V for one (row, head): ``D``-contiguous loads from
the paged cache, contiguous stores into ``compact[slot, head]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# values that change with the batch (selection size): no compiled variant each
@triton.jit(do_not_specialize=["stride_btb", "stride_pb", "stride_ph"])
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


# values that change with the batch (rows, selection size, sinks): no compiled variant each
@triton.jit(do_not_specialize=["stride_btb", "stride_sb", "stride_sh", "stride_meta", "sinks"])
def _repack_selected(KC, VC, BT, SEL, META, CK, CV, LEN, WSD, MAP,
                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
                     stride_sb, stride_sh, stride_meta, stride_cks, stride_ckh, stride_ckn,
                     stride_cvs, stride_cvh, stride_cvn, sinks,
                     D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PUBLISH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    target = tl.load(META + b).to(tl.int64)
    count = tl.where(target >= 0, tl.load(META + stride_meta + b), 0)  # target -1: padding, nothing written
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < count
    sel = tl.load(SEL + b * stride_sb + h * stride_sh + (n - sinks), mask=nmask & (n >= sinks), other=0)
    pos = tl.where(n < sinks, n.to(tl.int64), sel.to(tl.int64))
    blk = tl.load(BT + b * stride_btb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
    off = pos % PAGE
    m2 = nmask[:, None]
    offs_d = tl.arange(0, D)
    k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=m2)
    tl.store(CK + target * stride_cks + h * stride_ckh + n[:, None] * stride_ckn + offs_d[None, :], k, mask=m2)
    v = tl.load(VC + blk[:, None] * stride_vb + off[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=m2)
    tl.store(CV + target * stride_cvs + h * stride_cvh + n[:, None] * stride_cvn + offs_d[None, :], v, mask=m2)
    if PUBLISH:
        if (h == 0) & (t == 0) & (target >= 0):
            tl.store(LEN + target, count)
            tl.store(WSD + target, tl.load(META + 2 * stride_meta + b))
            tl.store(MAP + tl.load(META + 3 * stride_meta + b), target.to(tl.int32))


def repack_selected(key_cache, value_cache, block_table, selected, sinks: int, meta, compact_k, compact_v,
                    length_dev, window_start_dev, slot_map_dev, publish: bool = True, block_n: int = 64) -> None:
    """:func:`repack` of ``sinks`` + a selection, and the metadata writes of a publish, in one launch.

    ``selected (B, Hkv, K)`` absolute positions (:func:`sfi_vllm.selector.top_k_positions`);
    ``meta (4, B)`` int32: physical set written, tokens (``sinks`` + row ``b``'s share of
    ``selected``), window start, logical slot; a row whose set is ``-1`` is padding and writes
    nothing (a CUDA graph captured for more rows than a step has). Row ``b``'s set is positions ``0 .. sinks - 1``
    followed by ``selected[b, h, :meta[1, b] - sinks]``. Then, with ``publish``, as
    :meth:`sfi_vllm.compact.PackedCompactBuffer.pack_rows` does in torch:
    ``length_dev[set] = tokens``, ``window_start_dev[set] = window start`` and
    ``slot_map_dev[slot] = set`` (stream order makes them visible after the copy; nothing in this
    launch reads them). Reads device inputs only, so a CUDA graph can replay it with new ones."""
    B, Hkv, K = selected.shape
    D = key_cache.shape[-1]
    assert meta.shape == (4, B) and meta.dtype == torch.int32 and meta.stride(1) == 1
    assert selected.stride(-1) == 1
    _repack_selected[(B, Hkv, triton.cdiv(sinks + K, block_n))](
        key_cache, value_cache, block_table, selected, meta, compact_k, compact_v,
        length_dev, window_start_dev, slot_map_dev,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        selected.stride(0), selected.stride(1), meta.stride(0),
        compact_k.stride(0), compact_k.stride(1), compact_k.stride(2),
        compact_v.stride(0), compact_v.stride(1), compact_v.stride(2), sinks,
        D=D, PAGE=key_cache.shape[1], BLOCK_N=block_n, PUBLISH=publish,
    )
