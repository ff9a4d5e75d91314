"""The Selector's top-K on the GPU, under CUDA graphs: torch (topk + sort) against the Triton kernel.

    python3 benchmarks/topk_bench.py --out DIR      # on the device machine

The shapes are those the per-step refresh hands to top-K in e2e_bench.py's runs (Qwen3-4B shape,
8 KV heads, K = 2048, sinks 4; one chunk of layers per launch, as many layers as the refresh's
256 MiB logits budget allows): rows = layers in the chunk x slow rows. Each time is the median
over 5 x 200 replays of a graph holding one call (``attn_timing.graph_time_us``). Scores are
random normal; each point also checks that both give the same positions (no ties in such data).
Writes topk-h200.jsonl to DIR and prints one JSON object per point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from attn_timing import graph_time_us  # noqa: E402

HKV, K, SINKS = 8, 2048, 4
# (label, slow rows, layers per chunk, frame width): frames are the context rounded up to 2048
POINTS = [("1x8K", 1, 36, 10240), ("1x32K", 1, 36, 34816), ("16x16K", 16, 5, 18432),
          ("8x32K", 8, 5, 34816), ("6x128K", 6, 1, 133120)]  # 6x128K: per-layer refresh


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from sfi_vllm.selector import top_k_positions
    from sfi_vllm.kernels.top_k import top_k_positions as top_k_kernel

    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, slow_rows, layers, width in POINTS:
        b = slow_rows * layers
        scores = torch.randn(b, HKV, width, device="cuda", generator=g)
        budgets = torch.full((b,), K, dtype=torch.long, device="cuda")
        same = torch.equal(top_k_positions(scores, SINKS, budgets, K), top_k_kernel(scores, SINKS, budgets, K))
        torch_us = graph_time_us(lambda: top_k_positions(scores, SINKS, budgets, K))
        triton_us = graph_time_us(lambda: top_k_kernel(scores, SINKS, budgets, K))
        row = dict(point=label, rows=b, kv_heads=HKV, width=width, k=K, torch_us=round(torch_us, 1),
                   triton_us=round(triton_us, 1), speedup=round(torch_us / triton_us, 2),
                   per_layer_torch_us=round(torch_us / layers, 1), per_layer_triton_us=round(triton_us / layers, 1),
                   same_positions=same, gpu=torch.cuda.get_device_name())
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk-h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    return 0 if all(r["same_positions"] for r in rows_out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
