"""Slow-step scores: the decode query's attention logits over the whole paged history, and the
key norms the Selector's prior reads.

FlashAttention returns no probabilities, so a slow step needs its own ``q . k`` pass. Reference:
:func:`sfi_vllm.attention_ref.attention_probs` (``softmax`` of these logits over ``[0, seq_len)``)
and ``keys.norm(dim=-1)``, on the keys :meth:`sfi_vllm.paged_kv.PagedKV.gather_range` reads.

Grid ``(rows, kv_heads, tiles)``: each program loads ``BLOCK_N`` keys of one KV head from the paged
cache once and scores them against every query head of its GQA group (padded to 16 rows for
``tl.dot``). Positions at or past ``seq_len`` get ``-inf`` logits and zero norms, so a batch of rows
with different contexts shares one ``(rows, Hkv, G, width)`` frame.

On the H200 the kernel reads keys at 3.0-3.2 TB/s; the same loads writing only the norms run at
4.0-4.2 TB/s, and neither other tiles, more warps, several KV heads per program nor a
multiply-and-sum in place of ``tl.dot`` came closer (benchmarks/results/score-kernel-h200.md).
``block_n`` and ``num_warps`` are launch parameters: they change float summation order, not what
is computed; ``benchmarks/score_kernel_bench.py`` times them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch defaults: 64 keys per program, 4 warps (Triton's default); the fastest of the sweep at
# every point measured
BLOCK_N = 64
NUM_WARPS = 4


@triton.jit(do_not_specialize=["stride_btb"])  # the block table's width changes with the batch
def _slow_scores(Q, KC, BT, SEQ, LOGITS, NORMS,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                 stride_lb, stride_lh, stride_lg, stride_nb, stride_nh,
                 width, scale,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    seq = tl.load(SEQ + b)
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    in_frame = n < width
    valid = n < seq
    offs_d = tl.arange(0, D)
    blk = tl.load(BT + b * stride_btb + n // PAGE, mask=valid, other=0).to(tl.int64)
    off = (n % PAGE).to(tl.int64)
    k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k)) * scale
    qk = tl.where(valid[None, :], qk, float("-inf"))
    tl.store(LOGITS + b * stride_lb + h * stride_lh + offs_g[:, None] * stride_lg + n[None, :], qk,
             mask=gmask[:, None] & in_frame[None, :])
    kf = k.to(tl.float32)
    norm = tl.sqrt(tl.sum(kf * kf, 1))
    tl.store(NORMS + b * stride_nb + h * stride_nh + n, norm, mask=in_frame)


def slow_step_scores(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, width: int, scale: float, block_n: int = BLOCK_N,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, Hq, D)`` against ``key_cache (blocks, page, Hkv, D)`` through ``block_table (B, .)``
    -> ``(logits (B, Hkv, G, width), key_norms (B, Hkv, width))``, float32 (into ``out`` if given).
    ``block_n`` and ``num_warps`` are launch parameters."""
    B, Hq, D = q.shape
    Hkv = key_cache.shape[2]
    G = Hq // Hkv
    if out is not None:
        logits, norms = out
        assert logits.shape == (B, Hkv, G, width) and norms.shape == (B, Hkv, width)
    else:
        logits = torch.empty(B, Hkv, G, width, dtype=torch.float32, device=q.device)
        norms = torch.empty(B, Hkv, width, dtype=torch.float32, device=q.device)
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1
    _slow_scores[(B, Hkv, triton.cdiv(width, block_n))](
        q, key_cache, block_table, seq_lens, logits, norms,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        logits.stride(0), logits.stride(1), logits.stride(2), norms.stride(0), norms.stride(1),
        width, scale,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, PAGE=key_cache.shape[1],
        num_warps=num_warps,
    )
    return logits, norms
