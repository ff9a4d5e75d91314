"""Kernel-level timing on the GPU, under CUDA graphs: SFI's fast-step kernel vs vLLM's FA3 decode.

    python3 benchmarks/kernel_bench.py --out DIR      # on the device machine, with vLLM 0.26

Qwen3-4B attention shape (32 query / 8 KV heads, head_dim 128, bf16, page 16). For each point it
captures one launch in a CUDA graph, replays it many times and reports the median per launch:
* dense: FA3 (``flash_attn_varlen_func``, paged, ``seqused_k`` = context) over the whole context;
* sfi: the fast-step kernel over sinks+selected (compact buffer) + a 256-token paged window, the
  working set being ``retention`` x context tokens;
* fa3_same_bytes: FA3 over the first ``retention`` x context tokens (the same bytes, for scale);
* repack: gathering 2048 selected tokens x 8 heads x 16 sequences into the compact buffers.
Writes kernel-h200.jsonl (one object per point) and kernel-h200.md to DIR and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


from attn_timing import D, HKV, SINKS, WINDOW, graph_time_us, setup, sfi_fast_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from sfi_vllm.kernels.repack import repack

    scale = D ** -0.5
    rows = []

    def fa3(q, kc, vc, bt, lens, max_len):
        B = q.shape[0]
        cu_q = torch.arange(B + 1, device=q.device, dtype=torch.int32)
        out = torch.empty_like(q)
        return lambda: flash_attn_varlen_func(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                              seqused_k=lens, max_seqlen_k=max_len, softmax_scale=scale,
                                              causal=True, block_table=bt, fa_version=3)

    points = [(16, 16384, r) for r in (0.016, 0.063, 0.125, 0.25, 0.375, 0.5, 0.75, 0.984)]
    points += [(16, 16384, (SINKS + 2048 + WINDOW) / 16384), (6, 131072, (SINKS + 2048 + WINDOW) / 131072)]
    dense_cache = {}
    for batch, context, retention in points:
        kv, kc, vc, bt, q = setup(batch, context)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        if (batch, context) not in dense_cache:
            dense_cache[(batch, context)] = graph_time_us(fa3(q, kc, vc, bt, lens, context))
        dense_us = dense_cache[(batch, context)]
        keep = max(WINDOW + SINKS, round(retention * context))
        n_compact = keep - WINDOW
        same = torch.full((batch,), keep, device="cuda", dtype=torch.int32)
        fa3_same = graph_time_us(fa3(q, kc, vc, bt, same, keep))
        sfi_us, ns = sfi_fast_us(q, kc, vc, bt, lens, n_compact, context - WINDOW)
        nbytes = batch * keep * HKV * D * 2 * q.element_size()
        row = dict(batch=batch, context=context, retention=round(keep / context, 4), tokens=keep,
                   dense_us=round(dense_us, 1), sfi_us=round(sfi_us, 1), speedup=round(dense_us / sfi_us, 2),
                   fa3_same_bytes_us=round(fa3_same, 1), sfi_bytes_per_s=round(nbytes / (sfi_us * 1e-6), 1),
                   sfi_tb_s=round(nbytes / (sfi_us * 1e-6) / 1e12, 2), splits=ns)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv, kc, vc
        torch.cuda.empty_cache()

    # repack: 2048 tokens x 8 heads x 16 sequences at 16K context
    kv, kc, vc, bt, q = setup(16, 16384)
    pos = torch.sort(torch.rand(16, HKV, 16384, device="cuda").argsort(-1)[..., :2048], -1).values.int()
    ck = torch.empty(16, HKV, 2048, D, device="cuda", dtype=q.dtype)
    cv = torch.empty_like(ck)
    npos = torch.full((16,), 2048, device="cuda", dtype=torch.int32)
    slots = torch.arange(16, device="cuda", dtype=torch.int32)
    rep_us = graph_time_us(lambda: repack(kc, vc, bt, slots, pos, npos, ck, cv))
    rep_bytes = 2 * 16 * HKV * 2048 * D * 2 * 2  # read + write, K and V
    repack_row = dict(kind="repack", batch=16, tokens=2048, kv_heads=HKV, us=round(rep_us, 1),
                      bytes_per_s=round(rep_bytes / (rep_us * 1e-6), 1))
    print(json.dumps(repack_row))

    out = Path(args.out)
    with open(out / "kernel-h200.jsonl", "w") as f:
        for r in rows + [repack_row]:
            f.write(json.dumps(r) + "\n")
    lines = ["| batch | context | retention | tokens | dense FA3 us | SFI fast us | speedup | FA3 same bytes us | SFI TB/s | splits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {100 * r['retention']:.1f}% | {r['tokens']} | {r['dense_us']} | "
                     f"{r['sfi_us']} | {r['speedup']}x | {r['fa3_same_bytes_us']} | {r['sfi_tb_s']} | {r['splits']} |")
    lines.append(f"\nrepack, 2048 tokens x 8 KV heads x 16 sequences: {repack_row['us']} us "
                 f"({repack_row['bytes_per_s'] / 1e12:.2f} TB/s read+write)")
    (out / "kernel-h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
