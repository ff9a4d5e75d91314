"""A trial: the slow-step score kernel with each program looping over several tiles, its loads
software-pipelined by Triton, against the kernel as it is.

    python3 benchmarks/score_kernel_pipelined.py --out DIR      # on the device machine (torch + Triton)

The score kernel runs one tile per program; the same loads writing only the norms read at 4.0-4.2
TB/s, the kernel at 3.1-3.2 (results/score-kernel-h200.md). One explanation: its ``tl.dot`` and
logits store take registers and shared memory, so fewer programs are resident per SM and fewer
loads are in flight. Here a program keeps ``q`` and loops over ``tiles`` tiles with
``tl.range(..., num_stages=stages)``, so that the next tiles' keys are being fetched while one is
scored. Timed and checked as in score_kernel_bench.py (same shapes, vLLM's cache layout, logits and
norms compared with the kernel's); writes score-kernel-pipelined-h200.jsonl to DIR.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from attn_timing import D, HKV, HQ, graph_time_us  # noqa: E402
from score_kernel_bench import key_cache_and_table  # noqa: E402


@triton.jit(do_not_specialize=["stride_btb"])
def _scores_pipelined(Q, KC, BT, SEQ, LOGITS, NORMS,
                      stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                      stride_lb, stride_lh, stride_lg, stride_nb, stride_nh,
                      width, scale,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGE: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    seq = tl.load(SEQ + b)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    L = LOGITS + b * stride_lb + h * stride_lh
    N = NORMS + b * stride_nb + h * stride_nh
    for i in tl.range(0, TILES, num_stages=STAGES):
        n = (c * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_frame = n < width
        valid = n < seq
        blk = tl.load(BT + b * stride_btb + n // PAGE, mask=valid, other=0).to(tl.int64)
        off = (n % PAGE).to(tl.int64)
        k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        tl.store(L + offs_g[:, None] * stride_lg + n[None, :], qk, mask=gmask[:, None] & in_frame[None, :])
        kf = k.to(tl.float32)
        tl.store(N + n, tl.sqrt(tl.sum(kf * kf, 1)), mask=in_frame)


def scores_pipelined(q, key_cache, block_table, seq_lens, width, scale, out, block_n=64, tiles=8, stages=3,
                     num_warps=4):
    B, Hq, _ = q.shape
    Hkv = key_cache.shape[2]
    G = Hq // Hkv
    logits, norms = out
    _scores_pipelined[(B, Hkv, triton.cdiv(triton.cdiv(width, block_n), tiles))](
        q, key_cache, block_table, seq_lens, logits, norms,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), logits.stride(0), logits.stride(1), logits.stride(2), norms.stride(0),
        norms.stride(1), width, scale,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=q.shape[2], BLOCK_N=block_n, PAGE=key_cache.shape[1],
        TILES=tiles, STAGES=stages, num_warps=num_warps)
    return logits, norms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="1x131072,6x131072,16x16384,8x32768")
    ap.add_argument("--tiles", default="2,4,8,16")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--block-n", default="64")
    args = ap.parse_args()
    from sfi_vllm.kernels.slow_scores import slow_step_scores

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    for point in args.points.split(","):
        B, ctx = (int(x) for x in point.split("x"))
        kc, bt, q = key_cache_and_table(B, ctx, False)
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        width = -(-ctx // 2048) * 2048
        key_bytes = B * ctx * HKV * D * kc.element_size()
        lg = torch.empty(B, HKV, HQ // HKV, width, device="cuda")
        nm = torch.empty(B, HKV, width, device="cuda")
        us = graph_time_us(lambda: slow_step_scores(q, kc, bt, lens, width, D ** -0.5, out=(lg, nm)))
        ref = (lg.clone(), nm.clone())
        base = dict(batch=B, context=ctx, kernel="slow_step_scores", us=round(us, 1),
                    tbps=round(key_bytes / us / 1e6, 2))
        rows.append(base)
        print(json.dumps(base), flush=True)
        for block_n, tiles, stages in itertools.product(*(map(int, a.split(",")) for a in
                                                          (args.block_n, args.tiles, args.stages))):
            lg2, nm2 = torch.full_like(lg, float("nan")), torch.full_like(nm, float("nan"))

            def launch():
                return scores_pipelined(q, kc, bt, lens, width, D ** -0.5, (lg2, nm2), block_n, tiles, stages)

            try:
                t = graph_time_us(launch)
            except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build is reported
                row = dict(batch=B, context=ctx, block_n=block_n, tiles=tiles, stages=stages,
                           error=f"{type(e).__name__}: {e}"[:200])
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            launch()
            torch.cuda.synchronize()
            same = torch.equal(lg2, ref[0]) and torch.equal(nm2, ref[1])
            ok &= same
            row = dict(batch=B, context=ctx, kernel="pipelined", block_n=block_n, tiles=tiles, stages=stages,
                       us=round(t, 1), tbps=round(key_bytes / t / 1e6, 2), same_as_kernel=same,
                       vs_kernel=round(us / t, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        kc = bt = q = None  # free the cache before the next point
        torch.cuda.empty_cache()
    with open(out_dir / "score-kernel-pipelined-h200.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
