"""Top-K over pages (page selection's step 6) in one launch per call.

Reference (the spec): :func:`sfi_vllm.selector.top_k_pages`. Per row and KV head, pages are taken
whole in descending page score until the row's budget ``k`` is reached; of the page that would pass
the budget, its best tokens by ``log s`` (ties to the lower position). The output is the chosen
candidates' absolute positions ascending, then ``W + lo`` as padding, as
:func:`sfi_vllm.selector.top_k_positions` writes them. Ties between equal page scores go to the
lower page (``torch.topk``, which the reference runs, leaves their order unspecified: the two agree
wherever no two pages among the best ``kp`` have equal scores).

The reference is a dozen torch launches (a radix select, a sort of the best pages, gathers, scans
and scatters). One program per (row, KV head) here:

1. :func:`sfi_vllm.kernels.top_k._radix_select` finds the ``kp``-th best page score
   (``kp = ceil(kmax / page) + 1`` pages always hold the budget, as in the reference), and one pass
   in page order writes the ``kp`` best pages to a scratch row, each as one int64 that orders by
   (score, lower page first).
2. ``tl.sort`` puts them best first; the pages' tokens (``kp x page`` loads of ``log s``) give each
   page's count of candidates, their exclusive prefix sum the tokens the better pages take, and so
   which pages are taken whole and which one in part. The page taken in part ranks its tokens.
3. A second ``tl.sort`` on (page, bit mask of its taken tokens) puts the pages back in position
   order, and a prefix sum over the masks' bits gives each taken token its output slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sfi_vllm.kernels.top_k import _radix_select, _sort_key
from sfi_vllm.selector import PageScores

_LOW32 = 0xFFFFFFFF


# every integer that follows the batch or its budgets (the output's strides follow kmax), so that
# Triton's specialisation of integers (equal to 1, multiples of 16) never makes a new variant
@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_tb", "stride_th", "stride_ob", "stride_oh",
                               "units", "width", "kmax", "kp"])
def _top_k_pages(PAGES, TOKENS, K, OUT, SCRATCH,
                 stride_pb, stride_ph, stride_tb, stride_th, stride_ob, stride_oh,
                 units, width, lo, kmax, kp,
                 HKV: tl.constexpr, PAGE: tl.constexpr, KP_PAD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    row = PAGES + b * stride_pb + h * stride_ph
    toks = TOKENS + b * stride_tb + h * stride_th
    out = OUT + b * stride_ob + h * stride_oh
    scratch = SCRATCH + pid.to(tl.int64) * KP_PAD
    k = tl.minimum(tl.load(K + b), kmax).to(tl.int32)
    offs = tl.arange(0, BLOCK)

    # 1) the kp best pages, in page order, into the scratch row: (key - 2**31) << 32 | ~page, so
    # that int64 order is (score, lower page first)
    thr, need = _radix_select(row, units, kp, BLOCK)
    taken = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for start in range(0, units, BLOCK):
        j = start + offs
        inside = j < units
        key = _sort_key(tl.load(row + j, mask=inside, other=float("-inf")))
        eq = inside & (key == thr)
        tie_rank = ties_seen + tl.cumsum(eq.to(tl.int32), 0) - eq.to(tl.int32)
        pick = inside & ((key > thr) | (eq & (tie_rank < need)))
        slot = taken + tl.cumsum(pick.to(tl.int32), 0) - pick.to(tl.int32)
        packed = ((key - 0x80000000) << 32) | (0xFFFFFFFF - j.to(tl.int64))
        tl.store(scratch + slot, packed, mask=pick & (slot < kp))
        taken += tl.sum(pick.to(tl.int32), 0)
        ties_seen += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()  # the scratch row is written and read by different threads of the program

    # 2) best page first: each page's candidates, the tokens the better pages take, this page's share
    r = tl.arange(0, KP_PAD)
    present = r < kp
    best = tl.sort(tl.load(scratch + r, mask=present, other=-0x7FFFFFFFFFFFFFFF - 1), descending=True)
    page = 0xFFFFFFFF - (best & 0xFFFFFFFF)
    off = tl.arange(0, PAGE)
    pos = page[:, None] * PAGE + off[None, :]  # (KP_PAD, PAGE) candidate indices
    tok = tl.load(toks + pos, mask=present[:, None] & (pos < width), other=float("-inf"))
    valid = tok > float("-inf")
    counts = tl.sum(valid.to(tl.int32), 1)
    before = tl.cumsum(counts, 0) - counts
    take = tl.maximum(k - before, 0)
    whole = present & (take >= counts)
    partial = present & (take > 0) & (take < counts)
    bit = (tl.zeros([PAGE], tl.int64) + 1) << off.to(tl.int64)
    valid_bits = tl.sum(tl.where(valid, bit[None, :], 0), 1)
    # the page taken in part (at most one): its best `ptake` tokens by log s, ties to the lower
    ptok = tl.max(tl.where(partial[:, None], tok, float("-inf")), 0)  # (PAGE,), all -inf if none
    ptake = tl.sum(tl.where(partial, take, 0), 0)
    ahead = (ptok[None, :] > ptok[:, None]) | ((ptok[None, :] == ptok[:, None]) & (off[None, :] < off[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)  # [i]: tokens of the page before token i
    part_bits = tl.sum(tl.where((ptok > float("-inf")) & (rank < ptake), bit, 0), 0)
    mask = tl.where(whole, valid_bits, tl.where(partial, part_bits, 0))

    # 3) position order: pages ascending, each taken token at the running count of taken tokens
    order = tl.sort(tl.where(present, (page << PAGE) | mask, 0x7FFFFFFF << PAGE))  # absent: last, no bits
    page = order >> PAGE
    bits = ((order & ((1 << PAGE) - 1))[:, None] >> off[None, :].to(tl.int64)) & 1
    n_taken = tl.sum(bits, 1)
    slot = (tl.cumsum(n_taken, 0) - n_taken)[:, None] + tl.cumsum(bits, 1) - bits
    pos = page[:, None] * PAGE + off[None, :]
    tl.store(out + slot, pos + lo, mask=(bits == 1) & (slot < k))
    total = tl.sum(n_taken, 0).to(tl.int32)
    for start in range(total, kmax, BLOCK):  # padding past the row's chosen candidates
        n = start + offs
        tl.store(out + n, tl.zeros([BLOCK], tl.int64) + width + lo, mask=n < kmax)


def supports(page: int) -> bool:
    """Page sizes the kernel takes: powers of two up to 32 (a page's tokens are one ``tl.arange``
    and its taken tokens one bit mask of the packed int64 it sorts by)."""
    return 1 < page <= 32 and page & (page - 1) == 0


# The smallest tile of best pages (a compile-time constant): every budget up to 255 pages (4,080
# tokens of 16-token pages) and every short context shares one compiled kernel
MIN_PAGE_TILE = 256


def page_tile(kmax: int, page: int, units: int) -> int:
    """The kernel's tile of best pages for a call: ``kp = min(units, ceil(kmax / page) + 1)``
    rounded up to a power of two, at least :data:`MIN_PAGE_TILE`."""
    return max(MIN_PAGE_TILE, triton.next_power_of_2(min(units, -(-kmax // page) + 1)))


def top_k_pages(scores: PageScores, lo: int, k: torch.Tensor, kmax: int, block: int = 1024,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``scores``: :class:`~sfi_vllm.selector.PageScores` (``pages (B, Hkv, U)`` and
    ``tokens (B, Hkv, W)`` float32, last dims contiguous; a page size of at most 32), ``k (B,)`` ->
    ``(B, Hkv, kmax)`` int64 absolute positions, as :func:`sfi_vllm.selector.top_k_pages`. ``block``
    (the page tile of the radix passes) is a launch parameter."""
    pages, tokens, g = scores
    B, hkv, units = pages.shape
    width = tokens.shape[-1]
    assert tokens.shape[:2] == (B, hkv) and units == -(-width // g)
    assert pages.dtype == torch.float32 and tokens.dtype == torch.float32
    assert pages.stride(-1) == 1 and tokens.stride(-1) == 1
    assert supports(g), "page size: a power of two, at most 32 (the bit masks)"
    if out is None:
        out = torch.empty(B, hkv, kmax, dtype=torch.long, device=pages.device)
    assert out.shape == (B, hkv, kmax) and out.stride(-1) == 1
    kp = min(units, -(-kmax // g) + 1)
    kp_pad = page_tile(kmax, g, units)
    scratch = torch.empty(B * hkv, kp_pad, dtype=torch.long, device=pages.device)
    _top_k_pages[(B * hkv,)](pages, tokens, k, out, scratch, pages.stride(0), pages.stride(1),
                             tokens.stride(0), tokens.stride(1), out.stride(0), out.stride(1),
                             units, width, lo, kmax, kp, HKV=hkv, PAGE=g, KP_PAD=kp_pad, BLOCK=block)
    return out
