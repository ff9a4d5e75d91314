"""Dense rows (no compact set: a bridge step's, a first selection's) in the fast-step kernel: the time
of one launch under a CUDA graph by launch parameters, at four decode points, every row at the full
context; prints one line per variant. Needs only torch and Triton (it imports the kernel module
from kernels/, not the package), so it runs on a GPU machine without vLLM; FA3's times at the same
points are e2e_bench.py's ``dense_attn_us``. Result: benchmarks/results/dense-rows-h200.txt.

    python3 benchmarks/dense_rows_tune.py
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "kernels")]
import fast_decode as fd  # noqa: E402
from attn_timing import D, HKV, HQ, graph_time_us, setup  # noqa: E402

POINTS = ((16, 16384), (8, 32768), (6, 131072), (1, 131072))


def sweep(batch: int, context: int) -> None:
    kv, kc, vc, bt, q = setup(batch, context)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    slots = torch.full((batch,), -1, device="cuda", dtype=torch.int32)  # every row dense
    zeros = torch.zeros(batch, device="cuda", dtype=torch.int32)
    ck = torch.zeros(1, HKV, 16, D, device="cuda", dtype=q.dtype)
    cv = torch.zeros_like(ck)
    nc = torch.zeros(1, device="cuda", dtype=torch.int32)
    ws = torch.zeros(1, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    splits = fd.uniform_num_splits(batch, HKV)
    nbytes = batch * context * HKV * D * 4
    ref = None
    for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        w = fd.make_workspace(batch, HQ, D, splits, "cuda")

        def launch():
            fd.fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5, splits,
                                     out=out, workspace=w, block_n=bn, num_warps=warps, num_stages=stages)
        name = f"{batch}x{context} splits={splits} bn={bn} w={warps} s={stages}"
        try:
            us = graph_time_us(launch, replays=50)
        except Exception as e:  # out of resources etc.
            print(f"{name}: {type(e).__name__}", flush=True)
            continue
        if ref is None:
            ref = out.float().clone()
        err = (out.float() - ref).abs().max().item()
        print(f"{name}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s err={err:.1e}", flush=True)


def main() -> None:
    for batch, context in POINTS:
        sweep(batch, context)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
