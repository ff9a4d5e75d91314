"""What a slow step's selection costs with the default Selector (16-token pages, following pages)
against the paper's token-level one, on the GPU, under CUDA graphs.

    python3 benchmarks/selection_cost.py --out DIR      # on the device machine (torch + Triton)

Shapes as in ``selector_bench.py`` (Qwen3-4B: 8 KV heads, G = 4, sinks 4, K = 2048; rows = slow
rows x the layers of one refresh chunk). Each configuration is timed as the median over 5 x 200
replays of a graph holding the fused Selector's scores and torch's top-K
(``attn_timing.graph_time_us``). Fast steps run no selection code, so they are not timed here.
Writes selection-cost-h200.jsonl to DIR; prints one JSON object per point and configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from attn_timing import graph_time_us  # noqa: E402
from selector_bench import K, POINTS, SINKS, random_frame  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default=",".join([p[0] for p in POINTS] + ["6x128K"]))
    ap.add_argument("--profile", action="store_true",
                    help="also print the torch profiler's kernel table for the default Selector at each point")
    args = ap.parse_args()
    from sfi_vllm.config import build_config
    from sfi_vllm.selector import top_k_positions
    from sfi_vllm.kernels.selector_scores import selector_scores

    configs = {"default": build_config({}, use_env=False).selector,
               "paper": build_config({"preset": "paper"}, use_env=False).selector}
    wanted = set(args.points.split(","))
    points = POINTS + [("6x128K", 6, 1, 131072)]  # the per-layer refresh: one layer's six rows
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, slow_rows, layers, context in points:
        if label not in wanted:
            continue
        rows, width, logits, norms = random_frame(slow_rows, layers, context, gen)
        n = torch.full((rows,), float(context - SINKS - 256), device="cuda")
        k = torch.full((rows,), K, dtype=torch.long, device="cuda")
        for name, cfg in configs.items():
            def call(cfg=cfg, logits=logits, norms=norms, n=n, k=k):
                return top_k_positions(selector_scores(cfg, logits, norms, SINKS, n), SINKS, k, K)

            row = dict(point=label, rows=rows, width=width, selector=name, page_size=cfg.page_size,
                       follow_pages=cfg.follow_pages, use_nms=cfg.use_nms,
                       select_us=round(graph_time_us(call), 1),
                       scores_us=round(graph_time_us(lambda cfg=cfg: selector_scores(cfg, logits, norms, SINKS, n)), 1),
                       gpu=torch.cuda.get_device_name())
            if cfg.page_size > 1:  # the top-K over float64 token scores that top_k_pages replaced
                def token_top_k(cfg=cfg):
                    s = selector_scores(cfg, logits, norms, SINKS, n)
                    tok = s.pages.double().repeat_interleave(cfg.page_size, -1)[..., :s.tokens.shape[-1]]
                    return top_k_positions(tok + 1e-4 * s.tokens.double(), SINKS, k, K)

                row["token_top_k_select_us"] = round(graph_time_us(token_top_k), 1)
                new, old = call(), token_top_k()
                row["same_as_token_top_k"] = sum(len(set(a) & set(b)) for a, b in
                                                 zip(new.flatten(0, 1).tolist(), old.flatten(0, 1).tolist())
                                                 ) / new.numel()
            print(json.dumps(row), flush=True)
            rows_out.append(row)
            if args.profile and name == "default":
                call()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        call()
                    torch.cuda.synchronize()
                print(f"# {label}, default Selector, 10 calls, eager")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        del logits, norms
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "selection-cost-h200.jsonl", "w") as f:
        for r in rows_out:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
