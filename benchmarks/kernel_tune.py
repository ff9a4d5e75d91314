"""Sweep launch parameters of the fast-step kernel at one point under CUDA graphs; prints one line
per variant. Used to pick the defaults; results in benchmarks/results/kernel-tune-h200.txt
(the default point: 16 x 16K, 12.5% retention).

    python3 benchmarks/kernel_tune.py [--point 6x131072 --keep 2308] [--splits 11,22] [--block-n 32,64]
        [--warps 4,8] [--stages 2,3,4]

``--keep``: the working set per row and KV head (the compact set plus the 256-token window).
Splits default to the engine's (``uniform_num_splits``, a CUDA-graph batch's count) and twice
and four times that, and :func:`default_num_splits`'s (kernel-tune-h200.txt swept 5, 10 and 20
at 16 x 16K: ``--splits 5,10,20`` repeats it).
"""

import argparse
import itertools

import torch

from attn_timing import HKV, HQ, D, WINDOW, graph_time_us, setup
from sfi_vllm.kernels.fast_decode import (default_num_splits, fast_decode_attention, make_workspace,
                                          uniform_num_splits)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--point", default="16x16384", help="BATCHxCONTEXT")
    ap.add_argument("--keep", type=int, default=2048, help="working set per row and KV head, window included")
    ap.add_argument("--splits", type=_ints, default=None)
    ap.add_argument("--block-n", type=_ints, default=[32, 64, 128])
    ap.add_argument("--warps", type=_ints, default=[4, 8])
    ap.add_argument("--stages", type=_ints, default=[2, 3, 4])
    args = ap.parse_args()
    batch, context = (int(x) for x in args.point.split("x"))
    keep = args.keep
    if keep <= WINDOW:
        raise SystemExit(f"--keep must exceed the {WINDOW}-token window (it includes it)")
    kv, kc, vc, bt, q = setup(batch, context)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    ck = torch.randn(batch, HKV, keep - WINDOW, D, device="cuda", dtype=q.dtype)
    cv = torch.randn_like(ck)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    nc = torch.full((batch,), keep - WINDOW, device="cuda", dtype=torch.int32)
    ws = lens - WINDOW
    zeros = torch.zeros(batch, device="cuda", dtype=torch.int32)  # no per-row window bound
    out = torch.empty_like(q)
    engine = uniform_num_splits(batch, HKV)
    splits_list = args.splits or sorted({engine, 2 * engine, 4 * engine, default_num_splits(batch, HKV, keep)})
    nbytes = batch * keep * HKV * D * 4
    print(f"# {batch}x{context}, working set {keep}, engine splits {engine}; bf16, Qwen3-4B attention shape",
          flush=True)
    for splits, bn, warps, stages in itertools.product(splits_list, args.block_n, args.warps, args.stages):
        w = make_workspace(batch, HQ, D, splits, "cuda")
        try:
            us = graph_time_us(lambda: fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5,
                                                             splits, out=out, workspace=w, block_n=bn,
                                                             num_warps=warps, num_stages=stages), replays=100)
        except Exception as e:  # out of resources etc.
            print(f"splits={splits} block_n={bn} warps={warps} stages={stages}: {type(e).__name__}")
            continue
        print(f"splits={splits} block_n={bn} warps={warps} stages={stages}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
