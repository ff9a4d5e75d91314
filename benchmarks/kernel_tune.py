"""Sweep launch parameters of the fast-step kernel at one point (16 x 16K, 12.5% retention), under
CUDA graphs; prints one line per variant. Used to pick the defaults; results in
benchmarks/results/kernel-tune-h200.txt.

    python3 benchmarks/kernel_tune.py
"""

import itertools

import torch

from kernel_bench import HKV, HQ, D, WINDOW, graph_time_us, setup
from sfi_vllm.kernels.fast_decode import default_num_splits, fast_decode_attention, make_workspace


def main():
    batch, context, keep = 16, 16384, 2048
    kv, kc, vc, bt, q = setup(batch, context)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    ck = torch.randn(batch, HKV, keep - WINDOW, D, device="cuda", dtype=q.dtype)
    cv = torch.randn_like(ck)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    nc = torch.full((batch,), keep - WINDOW, device="cuda", dtype=torch.int32)
    ws = lens - WINDOW
    zeros = torch.zeros(batch, device="cuda", dtype=torch.int32)  # no per-row window bound
    out = torch.empty_like(q)
    base = default_num_splits(batch, HKV, keep)
    nbytes = batch * keep * HKV * D * 4
    for splits, bn, warps, stages in itertools.product((base, 2 * base, 4 * base), (32, 64, 128), (4, 8), (2, 3, 4)):
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
