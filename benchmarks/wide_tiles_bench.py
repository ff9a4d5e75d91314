"""Wide tiles for long dense rows in the fast-step kernel (``wide_block_n``): one launch under a
CUDA graph, the engine's uniform split count and launch parameters (block_n 32, 4 warps, 2
stages), at four decode points, with the tiles off and on. Two row kinds per point: every row
dense at the full context (a bridge step's or a first selection's rows), and every row on the
default 2,308-token working set (2,052 compact tokens + a 256-token window: a fast step), the
second to see what the wider loop's presence costs the fast rows. Needs only torch and Triton;
FA3's times at the same points are e2e_bench.py's ``dense_attn_us`` (and the header of
benchmarks/results/dense-rows-h200.txt).

    python3 benchmarks/wide_tiles_bench.py
"""
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "kernels")]
import fast_decode as fd  # noqa: E402
from attn_timing import D, HKV, HQ, graph_time_us, row_kinds, setup  # noqa: E402

POINTS = ((16, 16384), (8, 32768), (6, 131072), (1, 131072))
VARIANTS = (("off", 0, 0), ("wide64", 64, 0), ("wide128", 128, 0))


def point(batch: int, context: int) -> None:
    kv, kc, vc, bt, q = setup(batch, context)
    (ck, cv, zeros, lens), kinds = row_kinds(batch, context, q)
    splits = fd.uniform_num_splits(batch, HKV)
    out = torch.empty_like(q)
    for kind, (slots, nc, ws, nbytes) in kinds.items():
        ref = None
        for name, wide_n, wide_from in VARIANTS:
            w = fd.make_workspace(batch, HQ, D, splits, "cuda")

            def launch():
                fd.fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5, splits,
                                         out=out, workspace=w, wide_block_n=wide_n, wide_from=wide_from)
            label = f"{batch}x{context} {kind} splits={splits} {name}"
            try:
                us = graph_time_us(launch, replays=50)
            except Exception as e:  # out of resources etc.
                print(f"{label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            print(f"{label}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s err={err:.1e}", flush=True)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for batch, context in POINTS:
        point(batch, context)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
