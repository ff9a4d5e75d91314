"""Top-K positions of the Selector's scores, ascending, in one launch: radix select + ordered compaction.

Reference (the spec): :func:`sfi_vllm.selector.top_k_positions`: ``scores (B, Hkv, W)`` over
candidates ``lo + j`` -> ``(B, Hkv, kmax)`` absolute positions, row ``b``'s best ``k[b]`` per head in
ascending order, then ``W + lo`` as padding. ``torch.topk`` followed by ``torch.sort`` (what the
reference runs) is a radix select, a gather and a radix sort per call; this kernel needs neither the
gather nor the sort, because it writes the chosen positions in position order as it finds them.
Ties at the threshold score go to the lower positions (``torch.topk`` leaves them unspecified, so
the two agree wherever the K-th best score is not tied).

One program per (row, KV head), reading the row's ``W`` scores five times (L2-resident for the
frames the engine uses):

1. Four radix passes over the scores' order-preserving 32-bit keys, 8 bits each, most significant
   first: a 256-bin histogram of the keys that share the prefix found so far narrows the K-th
   largest key down one byte per pass. At the end ``thr`` is the K-th largest key and ``ties`` the
   number of keys equal to it that belong to the top K.
2. One compaction pass in position order: a key above ``thr``, or equal to it among the first
   ``ties`` such keys, is written at the running count of chosen positions (``tl.cumsum``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sort_key(x):
    """float32 -> int64 key in [0, 2**32) with the floats' order (-inf lowest; -0.0 and 0.0 equal,
    as they compare)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    neg = bits >= 0x80000000
    return tl.where(neg, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def _radix_select(row, width, need, BLOCK: tl.constexpr):
    """The ``need``-th largest of the ``width`` float32 scores at ``row`` (``need >= 1``), as its
    key: ``(thr, ties)``, where ``ties`` is how many of the keys equal to ``thr`` belong to the
    top ``need``. Four radix passes, 8 bits each, most significant first: a 256-bin histogram of
    the keys that share the prefix found so far narrows the key down one byte per pass."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # p is a compile-time constant (static_range), so is shift
        hist = tl.zeros([256], tl.int32)
        for start in range(0, width, BLOCK):
            j = start + offs
            key = _sort_key(tl.load(row + j, mask=j < width, other=float("-inf")))
            match = (j < width) & ((key >> (shift + 8)) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            # non-matching keys go to bins 256..511, which are dropped (no histogram mask needed)
            both = tl.reshape(tl.histogram(tl.where(match, digit, 256 + digit), 512), (2, 256))
            hist += tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, both, 0), 0)
        # count of matching keys with a larger digit than d: total - inclusive prefix sum
        incl = tl.cumsum(hist, 0)
        total = tl.sum(hist, 0)
        above = total - incl  # keys with digit > d
        # the digit d with above[d] < need <= above[d] + hist[d]
        hit = (above < need) & (above + hist >= need)
        d = tl.max(tl.where(hit, bins, -1), 0)
        need = need - tl.sum(tl.where(bins == d, above, 0), 0)
        prefix = (prefix << 8) | d.to(tl.int64)
    return prefix, need


@triton.jit
def _top_k(S, K, OUT, stride_sb, stride_sh, stride_ob, stride_oh, width, lo, kmax,
           HKV: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    row = S + b * stride_sb + h * stride_sh
    out = OUT + b * stride_ob + h * stride_oh
    k = tl.minimum(tl.load(K + b), kmax).to(tl.int32)
    offs = tl.arange(0, BLOCK)

    # 1) radix select: the K-th largest key, and how many of its ties are taken
    thr, need = _radix_select(row, width, k, BLOCK)

    # 2) ordered compaction
    taken = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for start in range(0, width, BLOCK):
        j = start + offs
        valid = j < width
        key = _sort_key(tl.load(row + j, mask=valid, other=float("-inf")))
        eq = valid & (key == thr)
        tie_rank = ties_seen + tl.cumsum(eq.to(tl.int32), 0) - eq.to(tl.int32)
        pick = valid & ((key > thr) | (eq & (tie_rank < need)))
        slot = taken + tl.cumsum(pick.to(tl.int32), 0) - pick.to(tl.int32)
        tl.store(out + slot, (j + lo).to(tl.int64), mask=pick & (slot < k))
        taken += tl.sum(pick.to(tl.int32), 0)
        ties_seen += tl.sum(eq.to(tl.int32), 0)
    for start in range(k, kmax, BLOCK):  # padding past the row's K
        n = start + offs
        tl.store(out + n, tl.zeros([BLOCK], tl.int64) + width + lo, mask=n < kmax)


def top_k_positions(scores: torch.Tensor, lo: int, k: torch.Tensor, kmax: int, block: int = 1024,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``scores (B, Hkv, W)`` float32 (last dim contiguous), ``k (B,)`` -> ``(B, Hkv, kmax)`` int64
    absolute positions: row ``b``'s best ``min(k[b], kmax)`` per head ascending, then ``W + lo``."""
    B, hkv, width = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(-1) == 1
    if out is None:
        out = torch.empty(B, hkv, kmax, dtype=torch.long, device=scores.device)
    assert out.shape == (B, hkv, kmax) and out.stride(-1) == 1
    _top_k[(B * hkv,)](scores, k, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
                       width, lo, kmax, HKV=hkv, BLOCK=block)
    return out
