"""The fast-step kernel's split count in uniform (CUDA-graph) launches: one launch under a CUDA graph
by split count, at five decode points, for two row kinds: every row dense at the full context (a
bridge step's rows) and every row on the default 2,308-token working set (2,052 compact tokens + a
256-token window: a fast step). With ``sfi.balanced_splits: false`` (every row the same count;
balanced splits, the default, are timed by mixed_rows_bench.py) the engine takes
``uniform_num_splits(rows, kv_heads)`` splits (marked ``*``; ``experimental.one_wave_splits``'
count is marked ``w``); the sweep shows whether another count, e.g. one that keeps rows x KV heads x
splits within one wave of programs, reads the keys faster. Needs only torch and Triton; with vLLM
importable it also times FA3 over the dense rows.

    python3 benchmarks/splits_bench.py
"""
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "kernels")]
import fast_decode as fd  # noqa: E402
from attn_timing import D, HKV, HQ, graph_time_us, row_kinds, setup  # noqa: E402

POINTS = ((16, 16384), (8, 32768), (4, 32768), (6, 131072), (1, 131072))


def candidates(batch: int) -> list[int]:
    engine = fd.uniform_num_splits(batch, HKV)
    picks = {engine, fd.uniform_num_splits(batch, HKV, one_wave=True), max(1, engine - 1), engine + 1, engine + 2, max(1, engine // 2), engine * 2}
    picks |= {max(1, 528 // (batch * HKV)), max(1, 396 // (batch * HKV)), max(1, 264 // (batch * HKV))}
    return sorted(s for s in picks if s <= 128)


def point(batch: int, context: int) -> None:
    kv, kc, vc, bt, q = setup(batch, context)
    (ck, cv, zeros, lens), kinds = row_kinds(batch, context, q)
    engine = fd.uniform_num_splits(batch, HKV)
    one_wave = fd.uniform_num_splits(batch, HKV, one_wave=True)
    try:
        from attn_timing import fa3_us
        print(f"{batch}x{context} dense FA3: {fa3_us(q, kc, vc, bt, lens, context):.1f} us", flush=True)
    except ImportError:
        pass
    out = torch.empty_like(q)
    for kind, (slots, nc, ws, nbytes) in kinds.items():
        ref = None
        for splits in candidates(batch):
            w = fd.make_workspace(batch, HQ, D, splits, "cuda")

            def launch():
                fd.fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5, splits,
                                         out=out, workspace=w)
            mark = "*" if splits == engine else "w" if splits == one_wave else " "
            label = f"{batch}x{context} {kind} splits={splits:3d}{mark} programs={batch * HKV * splits:5d}"
            us = graph_time_us(launch, replays=50)
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            print(f"{label}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s err={err:.1e}", flush=True)


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name}, {props.multi_processor_count} SMs", flush=True)
    for batch, context in POINTS:
        point(batch, context)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
