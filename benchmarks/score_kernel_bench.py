"""The slow-step score kernel's launch parameters on the GPU, under CUDA graphs.

    python3 benchmarks/score_kernel_bench.py --out DIR      # on the device machine (torch + Triton, no vLLM)

The score kernel (:func:`sfi_vllm.kernels.slow_scores.slow_step_scores`) reads every key of a slow
row's context once per layer: at 1 x 128K in the engine it is the largest part of a slow step
(36 launches of about 89 us on the H200, benchmarks/results/profile-engine-h200-1x131072-probe.txt).
Here each configuration of its launch parameters (``block_n`` keys per program, ``num_warps``) is
timed at the Qwen3-4B attention shape (32 query / 8 KV heads,
head_dim 128, bf16, 16-token pages) on a key cache laid out as vLLM's (``(blocks, page, Hkv, D)``,
keys apart from values), each row's pages in order as a fresh engine allocates them (``--shuffle``:
in random order). Time: the median over 5 x 200 replays of a graph holding one launch
(``attn_timing.graph_time_us``). ``tbps``: the keys' bytes over that time. Each configuration's
logits and norms are compared with the defaults' (``max_err``). Prints one JSON object per point
and configuration and, per point, the configurations ranked; writes score-kernel-h200.jsonl to DIR;
exits 1 if a configuration's output differs from the defaults'.

``--ceiling`` adds, per point, two reads of the same keys that compute almost nothing: ``norms_only``
(a Triton kernel with the score kernel's default grid and tile that loads the keys and writes their
norms, no logits) and ``torch_sum`` (``torch.sum`` over the key cache's contiguous blocks, the
same bytes read in order): what the access pattern alone allows, against what the score kernel gets.
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

from attn_timing import D, HKV, HQ, PAGE, graph_time_us  # noqa: E402

POINTS = "1x131072,6x131072,8x32768,16x16384"


def key_cache_and_table(batch: int, context: int, shuffle: bool, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = -(-context // PAGE)
    nb = batch * blocks + 8
    key_cache = torch.randn(nb, PAGE, HKV, D, device="cuda", dtype=dtype, generator=g)
    order = (torch.randperm(nb - 8, device="cuda", generator=g) if shuffle
             else torch.arange(nb - 8, device="cuda"))
    bt = order[: batch * blocks].view(batch, blocks).int()
    q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype, generator=g)
    return key_cache, bt, q


@triton.jit
def _norms_only(KC, BT, NORMS, stride_kb, stride_kt, stride_kh, stride_btb, stride_nb, stride_nh, ctx,
                D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The score kernel's loads and its norms, without the logits: a read ceiling for its grid."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = n < ctx
    blk = tl.load(BT + b * stride_btb + n // PAGE, mask=valid, other=0).to(tl.int64)
    off = (n % PAGE).to(tl.int64)
    k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh
                + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(NORMS + b * stride_nb + h * stride_nh + n, tl.sqrt(tl.sum(k * k, 1)), mask=valid)


def ceilings(kc, bt, B: int, ctx: int, width: int, key_bytes: int) -> list[dict]:
    """``norms_only`` and ``torch_sum`` at one point (see the module doc)."""
    from sfi_vllm.kernels.slow_scores import BLOCK_N

    nm = torch.empty(B, HKV, width, device="cuda")

    def norms():
        _norms_only[(B, HKV, triton.cdiv(ctx, BLOCK_N))](kc, bt, nm, kc.stride(0), kc.stride(1), kc.stride(2),
                                                        bt.stride(0), nm.stride(0), nm.stride(1), ctx,
                                                        D=D, BLOCK_N=BLOCK_N, PAGE=PAGE)

    blocks = kc[: B * (-(-ctx // PAGE))]
    out = []
    for name, fn in (("norms_only", norms), ("torch_sum", lambda: torch.sum(blocks, dtype=torch.float32))):
        try:
            us = graph_time_us(fn)
        except Exception as e:  # noqa: BLE001 - a reference that cannot be timed is reported, not fatal
            out.append(dict(batch=B, context=ctx, reference=name, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        out.append(dict(batch=B, context=ctx, width=width, reference=name, us=round(us, 1),
                        tbps=round(key_bytes / us / 1e6, 2)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--shuffle", action="store_true", help="each row's pages in random order")
    ap.add_argument("--ceiling", action="store_true", help="also time two plain reads of the same keys")
    args = ap.parse_args()
    from sfi_vllm.kernels import slow_scores

    configs = list(itertools.product(*(map(int, a.split(",")) for a in (args.block_n, args.warps))))
    default = (slow_scores.BLOCK_N, slow_scores.NUM_WARPS)
    if default in configs:
        configs.remove(default)
    configs.insert(0, default)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    for point in args.points.split(","):
        B, ctx = (int(x) for x in point.split("x"))
        kc, bt, q = key_cache_and_table(B, ctx, args.shuffle)
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        width = -(-ctx // 2048) * 2048
        key_bytes = B * ctx * HKV * D * kc.element_size()
        ref = None
        ranked = []
        for block_n, warps in configs:
            lg = torch.full((B, HKV, HQ // HKV, width), float("nan"), device="cuda")  # unwritten: NaN
            nm = torch.full((B, HKV, width), float("nan"), device="cuda")

            def launch():
                return slow_scores.slow_step_scores(q, kc, bt, lens, width, D ** -0.5, block_n=block_n,
                                                    out=(lg, nm), num_warps=warps)

            us = graph_time_us(launch)
            launch()
            torch.cuda.synchronize()
            if ref is None:
                ref = (lg.clone(), nm.clone())
            finite = torch.isfinite(ref[0])
            same_inf = torch.equal(torch.isfinite(lg), finite)
            err = max((lg[finite] - ref[0][finite]).abs().max().item(), (nm - ref[1]).abs().max().item())
            good = same_inf and err < 1e-3
            ok &= good
            row = dict(batch=B, context=ctx, width=width, shuffle=args.shuffle, block_n=block_n,
                       num_warps=warps, us=round(us, 1), tbps=round(key_bytes / us / 1e6, 2),
                       max_err=err, same_inf=same_inf, default=(block_n, warps) == default)
            rows.append(row)
            ranked.append(row)
            print(json.dumps(row), flush=True)
        if args.ceiling:
            for row in ceilings(kc, bt, B, ctx, width, key_bytes):
                rows.append(row)
                print(json.dumps(row), flush=True)
        ranked.sort(key=lambda r: r["us"])
        print(f"# {point}: " + "; ".join(f"bn{r['block_n']} w{r['num_warps']} {r['us']} us "
                                          f"({r['tbps']} TB/s)" for r in ranked[:6])
              + f"; default {ranked[[r['default'] for r in ranked].index(True)]['us']} us", flush=True)
        kc = bt = q = None  # free the cache before the next point
        torch.cuda.empty_cache()
    with open(out_dir / "score-kernel-h200.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
