"""Quest-style page scores: per page of ``PAGE`` tokens, the upper bound of ``q . k`` from the page's
per-dimension key min/max, for a batch of rows in one launch.

Reference: the scoring in :meth:`sfi_vllm.backends.common.SFILayer._quest_set` (keys gathered from
the paged cache in float32; ``bound = sum_d max(q_d * kmin_d, q_d * kmax_d)``, max over the query
heads of the KV head's group). Row ``b``'s pages start at token ``lo[b]``; it has ``n_pages[b]``
of them; scores past that are ``-inf``.

Grid ``(rows, kv_heads, page tiles)``: each program reads ``BLOCK_P`` pages of one KV head token
by token (``PAGE`` loads of ``BLOCK_P x D`` keys through the block table), keeps the running
min/max, then scores them against each query head of the group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quest_pages(Q, KC, BT, LO, NPAGES, OUT,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ob, stride_oh,
                 max_pages,
                 G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, KV_PAGE: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    lo = tl.load(LO + b)
    n_pages = tl.load(NPAGES + b)
    p = t * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < n_pages
    offs_d = tl.arange(0, D)
    kmin = tl.full([BLOCK_P, D], float("inf"), tl.float32)
    kmax = tl.full([BLOCK_P, D], float("-inf"), tl.float32)
    for i in tl.static_range(PAGE):
        pos = lo + p * PAGE + i
        blk = tl.load(BT + b * stride_btb + pos // KV_PAGE, mask=pmask, other=0).to(tl.int64)
        off = (pos % KV_PAGE).to(tl.int64)
        k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=pmask[:, None], other=0.0).to(tl.float32)
        kmin = tl.minimum(kmin, k)
        kmax = tl.maximum(kmax, k)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(Q + b * stride_qb + (h * G + g) * stride_qh + offs_d).to(tl.float32)
        s = tl.sum(tl.maximum(qg[None, :] * kmin, qg[None, :] * kmax), 1)
        best = tl.maximum(best, s)
    tl.store(OUT + b * stride_ob + h * stride_oh + p, tl.where(pmask, best, float("-inf")), mask=p < max_pages)


def quest_page_scores(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor, lo: torch.Tensor,
                      n_pages: torch.Tensor, page: int, max_pages: int, block_p: int = 16) -> torch.Tensor:
    """``q (B, Hq, D)`` against ``key_cache (blocks, kv_page, Hkv, D)`` through ``block_table
    (B, .)``; ``lo (B,)`` int32 first token of row ``b``'s first page, ``n_pages (B,)`` int32 ->
    ``(B, Hkv, max_pages)`` float32 page scores (``-inf`` past a row's pages)."""
    B, hq, d = q.shape
    hkv = key_cache.shape[2]
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert d & (d - 1) == 0 and 0 < page <= 128, "head size a power of two, page size at most 128"
    out = torch.empty(B, hkv, max_pages, dtype=torch.float32, device=q.device)
    _quest_pages[(B, hkv, triton.cdiv(max_pages, block_p))](
        q, key_cache, block_table, lo, n_pages, out,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1), max_pages,
        G=hq // hkv, D=d, PAGE=page, KV_PAGE=key_cache.shape[1], BLOCK_P=block_p,
    )
    return out
