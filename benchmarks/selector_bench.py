"""The fused Selector's launch parameters on the GPU, under CUDA graphs (steps 1-5, no top-K).

    python3 benchmarks/selector_bench.py --out DIR      # on the device machine (torch + Triton)

The shapes are those the per-step refresh hands to the Selector in e2e_bench.py's runs (Qwen3-4B
shape: 8 KV heads, G = 4, sinks 4; one chunk of layers per call, as many layers as the refresh's
256 MiB budget allows): rows = layers in the chunk x slow rows, frame = context rounded up to
2048, every row's candidates the whole context. Logits are random normal (x 3); the Selector's
work does not depend on their values. Each configuration of ``selector_scores``'s launch
parameters is timed as the median over 5 x 200 replays of a graph holding one call
(``attn_timing.graph_time_us``), and its scores are compared with those of the first
configuration (the defaults): ``max_abs_diff`` over finite scores, ``same_inf`` (the same
``-inf`` pattern), and ``topk_diff``, how many of the top-K positions per (row, head) differ
(summation order only; K = 2048). Writes selector-tune-h200.jsonl to DIR; prints one JSON object
per point and configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from attn_timing import graph_time_us  # noqa: E402

HKV, G, K, SINKS = 8, 4, 2048, 4
# (label, slow rows, layers per chunk, context): e2e_bench.py's points that take the per-step refresh
POINTS = [("8x32K", 8, 5, 32768), ("16x16K", 16, 5, 16384), ("1x128K", 1, 12, 131072), ("1x32K", 1, 36, 32768)]
# launch parameters: block, target_programs, num_warps, tile, nms_tile, nms_elems (first: the defaults)
CONFIGS = [
    (1024, 4096, 8, 1024, 1024, 8192),
    (1024, 512, 4, 256, 256, 2048),  # the earlier defaults
    (1024, 2048, 4, 256, 256, 2048),
    (1024, 512, 8, 256, 256, 2048),
    (2048, 2048, 8, 256, 256, 2048),
    (1024, 2048, 4, 1024, 256, 2048),
    (1024, 2048, 4, 256, 512, 4096),
    (512, 4096, 4, 256, 256, 2048),
]
KEYS = ("block", "target_programs", "num_warps", "tile", "nms_tile", "nms_elems")


def random_frame(slow_rows: int, layers: int, context: int, gen: torch.Generator, device: str = "cuda"):
    """A point's Selector inputs: ``(rows, width, logits, norms)`` for ``slow_rows x layers`` rows,
    random logits (x 3) and key norms over a frame of the context rounded up to 2048, ``-inf`` / 0
    past the context. The Selector's work does not depend on the values."""
    width = -(-context // 2048) * 2048
    rows = slow_rows * layers
    logits = torch.randn(rows, HKV, G, width, device=device, generator=gen) * 3
    logits[..., context:] = float("-inf")
    norms = torch.rand(rows, HKV, width, device=device, generator=gen) + 0.5
    norms[..., context:] = 0
    return rows, width, logits, norms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default=",".join(p[0] for p in POINTS))
    args = ap.parse_args()
    from sfi_vllm.config import build_config
    from sfi_vllm.kernels.selector_scores import selector_scores

    cfg = build_config({"preset": "balanced"}, use_env=False).selector
    wanted = set(args.points.split(","))
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, slow_rows, layers, context in POINTS:
        if label not in wanted:
            continue
        rows, width, logits, norms = random_frame(slow_rows, layers, context, gen)
        n = torch.full((rows,), float(context - SINKS), device="cuda")
        ref = None
        for conf in CONFIGS:
            params = dict(zip(KEYS, conf))

            def call(params=params, logits=logits, norms=norms, n=n):
                return selector_scores(cfg, logits, norms, SINKS, n, **params)

            us = graph_time_us(call)
            out = call()
            row = dict(point=label, rows=rows, width=width, **params, selector_us=round(us, 1),
                       gpu=torch.cuda.get_device_name())
            if ref is None:
                ref = out
            finite = torch.isfinite(ref)
            row["same_inf"] = bool(torch.equal(finite, torch.isfinite(out)))
            row["max_abs_diff"] = (out[finite] - ref[finite]).abs().max().item()
            top_ref = torch.topk(ref, K, dim=-1).indices.sort(-1).values
            top_out = torch.topk(out, K, dim=-1).indices.sort(-1).values
            row["topk_diff"] = int((top_ref != top_out).sum().item())
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        del logits, norms, ref
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "selector-tune-h200.jsonl", "w") as f:
        for r in rows_out:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
