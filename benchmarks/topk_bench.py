"""The Selector's top-K on the GPU, under CUDA graphs: torch against the Triton kernels.

    python3 benchmarks/topk_bench.py --out DIR [--pages] [--blocks 1024,2048]   # on the device machine

Token selection (default): ``torch.topk`` + ``torch.sort`` against ``kernels/top_k.py``. With
``--pages``, page selection (the default Selector: 16-token pages): torch's
:func:`sfi_vllm.selector.top_k_pages` against ``kernels/top_k_pages.py`` (one row per page tile of
``--blocks``), on the page scores the fused Selector computes from random logits at each point
(``selector_bench.random_frame``; a refresh chunk's rows, as ``selection_cost.py``); the rows are
written to topk-pages-h200.jsonl.

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
    ap.add_argument("--pages", action="store_true", help="page selection's top-K (module doc)")
    ap.add_argument("--blocks", default="1024", help="--pages: the kernel's page tiles to time")
    args = ap.parse_args()
    if args.pages:
        return pages(args)
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


def pages(args) -> int:
    from selector_bench import K as PK, POINTS as SEL_POINTS, SINKS as PSINKS, random_frame
    from sfi_vllm.config import build_config
    from sfi_vllm.kernels.selector_scores import selector_scores
    from sfi_vllm.kernels.top_k_pages import top_k_pages as kernel
    from sfi_vllm.selector import top_k_pages

    cfg = build_config({}, use_env=False).selector
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for label, slow_rows, layers, context in SEL_POINTS + [("6x128K", 6, 1, 131072)]:
        rows, width, logits, norms = random_frame(slow_rows, layers, context, gen)
        n = torch.full((rows,), float(context - PSINKS - 256), device="cuda")
        k = torch.full((rows,), PK, dtype=torch.long, device="cuda")
        sc = selector_scores(cfg, logits, norms, PSINKS, n)
        want = top_k_pages(sc, PSINKS, k, PK)
        row = dict(point=label, rows=rows, kv_heads=sc.pages.shape[1], pages=sc.pages.shape[-1],
                   page=sc.page, k=PK, torch_us=round(graph_time_us(lambda: top_k_pages(sc, PSINKS, k, PK)), 1))
        for block in map(int, args.blocks.split(",")):
            row[f"triton_b{block}_us"] = round(graph_time_us(lambda: kernel(sc, PSINKS, k, PK, block=block)), 1)
            row[f"same_b{block}"] = torch.equal(kernel(sc, PSINKS, k, PK, block=block), want)
        row["gpu"] = torch.cuda.get_device_name()
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk-pages-h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    return 0 if all(v for r in rows_out for key, v in r.items() if key.startswith("same")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
