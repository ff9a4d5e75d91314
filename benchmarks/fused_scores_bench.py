"""The fused slow-step scores under CUDA graphs: what writing logits and key norms costs the
fast-step kernel, against the separate score kernel it replaces.

    python3 benchmarks/fused_scores_bench.py --out DIR      # on the device machine (torch + Triton, no vLLM)

Per point (Qwen3-4B attention shape, every row at the full context), each a median over 5 x 200
replays of a graph holding one call (``attn_timing.graph_time_us``):
* ``dense_us``: the fast-step kernel with every row dense (a slow step under ``slow_in_graph``),
  no scores; ``scores_us``: the separate score kernel (``slow_step_scores``) on the same rows;
* ``fused_us``: the same dense rows writing their scores (``scores=``); ``saved_us`` = dense +
  scores - fused, what one layer of a slow step saves;
* ``fast_us`` / ``fast_fused_us``: a fast step (compact 2,052 + window 256) without and with the
  score arguments (no row scored): what the fused variant costs the steps that score nothing;
* ``keys_us_kb<N>``: the same fast rows all scored (keys-only slow rows, ``slow_attention: keys``): they
  attend through their sets and read the keys of the whole context once more for the scores, in
  tiles of ``N`` keys (``--key-blocks``; ``keys_us``: the kernel's default tile, when swept), checked like the
  dense rows' (``keys_logits_max_err_kb<N>``, ``keys_norms_max_err_kb<N>``, ``keys_same_output_kb<N>``);
  ``key_pass_tbps_kb<N>``: the keys' bytes over the time the scores add to ``fast_fused_us``;
* ``keys1_us`` / ``scores1_us``: one keys-only slow row among the batch's fast rows (the others
  unscored; requests whose refreshes fall on different steps), scored by the fast-step kernel's
  pass at the default tile, and the score kernel on that row alone (what the refresh runs with
  ``experimental.keys_only_scores: refresh``), checked like the others (``keys1_*``; and
  ``keys1_others_untouched``: the other rows' frames are not written).
The fused logits and norms are checked against the score kernel's (``logits_max_err``,
``norms_max_err``) and the attention output against the launch without scores (``same_output``).
Prints one JSON object per point; writes fused-scores-h200.jsonl to DIR; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from attn_timing import D, HKV, HQ, WINDOW, graph_time_us, setup  # noqa: E402

POINTS = [(8, 32768), (16, 16384), (1, 131072), (6, 131072)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS))
    ap.add_argument("--key-blocks", default="32,64,128",
                    help="keys-only score tiles to time (key_block_n): keys_us_kb<N> per tile, each checked")
    args = ap.parse_args()
    from sfi_vllm.kernels.fast_decode import (KEY_BLOCK_N, ScoreFrames, fast_decode_attention, make_workspace,
                                              uniform_num_splits)
    from sfi_vllm.kernels.slow_scores import slow_step_scores

    rows_out, ok = [], True
    for point in args.points.split(","):
        B, ctx = (int(x) for x in point.split("x"))
        kv, kc, vc, bt, q = setup(B, ctx)
        dev = q.device
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        zeros = torch.zeros(B, dtype=torch.int32, device=dev)
        ns = uniform_num_splits(B, HKV)
        work = make_workspace(B, HQ, D, ns, dev)
        width = -(-ctx // 2048) * 2048
        scale = D ** -0.5
        row = dict(batch=B, context=ctx, splits=ns, width=width)

        # dense rows (a slow step inside the graph)
        ck = torch.zeros(1, HKV, 16, D, dtype=q.dtype, device=dev)
        nc0 = torch.zeros(1, dtype=torch.int32, device=dev)
        dense_slot = torch.full((B,), -1, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)

        def dense(scores=None):
            return fast_decode_attention(q, ck, ck, kc, vc, bt, dense_slot, zeros, lens, nc0, nc0, scale, ns,
                                         out=out, workspace=work, scores=scores)

        row["dense_us"] = round(graph_time_us(dense), 1)
        plain = dense().clone()
        lg = torch.empty(B, HKV, HQ // HKV, width, device=dev)
        nm = torch.empty(B, HKV, width, device=dev)
        row["scores_us"] = round(graph_time_us(lambda: slow_step_scores(q, kc, bt, lens, width, scale,
                                                                       out=(lg, nm))), 1)
        base = (torch.arange(B, device=dev) * width).int()
        frames = ScoreFrames(base, torch.full((B,), B * width, dtype=torch.int32, device=dev),
                             torch.full((B,), width, dtype=torch.int32, device=dev),
                             torch.full((B * width * HQ,), float("nan"), device=dev),
                             torch.full((B * width * HKV,), float("nan"), device=dev), 0)
        dense(frames)
        row["same_output"] = torch.equal(out, plain)
        flg, fnm = frames.logits.view(B, HKV, HQ // HKV, width), frames.norms.view(B, HKV, width)
        row["logits_max_err"] = (flg[..., :ctx] - lg[..., :ctx]).abs().max().item()
        row["norms_max_err"] = (fnm[..., :ctx] - nm[..., :ctx]).abs().max().item()
        row["same_frame_tail"] = torch.equal(flg[..., ctx:], lg[..., ctx:]) and torch.equal(fnm[..., ctx:], nm[..., ctx:])
        ok &= (row["same_output"] and row["same_frame_tail"] and row["logits_max_err"] < 1e-3
               and row["norms_max_err"] < 1e-3)
        row["fused_us"] = round(graph_time_us(lambda: dense(frames)), 1)
        row["saved_us"] = round(row["dense_us"] + row["scores_us"] - row["fused_us"], 1)

        # fast rows: compact 2,052 + window 256, nothing scored
        nck = 2052
        ckf = torch.randn(B, HKV, nck, D, dtype=q.dtype, device=dev)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        ncf = torch.full((B,), nck, dtype=torch.int32, device=dev)
        wsf = torch.full((B,), ctx - WINDOW, dtype=torch.int32, device=dev)
        unscored = frames._replace(base=torch.full((B,), -1, dtype=torch.int32, device=dev))

        def fast(scores=None, key_block_n=None):
            return fast_decode_attention(q, ckf, ckf, kc, vc, bt, slots, zeros, lens, ncf, wsf, scale, ns,
                                         out=out, workspace=work, scores=scores, key_block_n=key_block_n)

        row["fast_us"] = round(graph_time_us(fast), 1)
        row["fast_fused_us"] = round(graph_time_us(lambda: fast(unscored)), 1)
        plain_fast = fast().clone()
        key_bytes = B * ctx * HKV * D * q.element_size()  # the keys the scored rows read once more
        row["key_block_default"] = KEY_BLOCK_N
        for kb in [int(x) for x in args.key_blocks.split(",") if x.strip()] or [KEY_BLOCK_N]:
            frames.logits.fill_(float("nan"))
            frames.norms.fill_(float("nan"))
            fast(frames, kb)  # every fast row scored: keys-only slow rows
            tag = f"_kb{kb}"
            row["keys_same_output" + tag] = torch.equal(out, plain_fast)
            row["keys_logits_max_err" + tag] = (flg[..., :ctx] - lg[..., :ctx]).abs().max().item()
            row["keys_norms_max_err" + tag] = (fnm[..., :ctx] - nm[..., :ctx]).abs().max().item()
            ok &= (row["keys_same_output" + tag] and row["keys_logits_max_err" + tag] < 1e-3
                   and row["keys_norms_max_err" + tag] < 1e-3)
            us = round(graph_time_us(lambda: fast(frames, kb)), 1)
            row["keys_us" + tag] = us
            # the pass over the keys alone: what the scored launch adds to the unscored one
            row["key_pass_tbps" + tag] = round(key_bytes / max(us - row["fast_fused_us"], 1e-3) / 1e6, 2)
            if kb == KEY_BLOCK_N:
                row["keys_us"] = us
        # one keys-only slow row among fast rows: the kernel's pass against the score kernel on the row
        one = frames._replace(base=torch.where(torch.arange(B, device=dev) == 0, frames.base, -1))
        frames.logits.fill_(float("nan"))
        frames.norms.fill_(float("nan"))
        fast(one)
        row["keys1_same_output"] = torch.equal(out, plain_fast)
        row["keys1_logits_max_err"] = (flg[0, ..., :ctx] - lg[0, ..., :ctx]).abs().max().item()
        row["keys1_norms_max_err"] = (fnm[0, ..., :ctx] - nm[0, ..., :ctx]).abs().max().item()
        # the other rows' frames are not written (they were filled with NaN)
        row["keys1_others_untouched"] = bool(torch.isnan(flg[1:]).all().item() and torch.isnan(fnm[1:]).all().item())
        ok &= (row["keys1_same_output"] and row["keys1_logits_max_err"] < 1e-3 and row["keys1_norms_max_err"] < 1e-3
               and row["keys1_others_untouched"])
        row["keys1_us"] = round(graph_time_us(lambda: fast(one)), 1)
        row["scores1_us"] = round(graph_time_us(lambda: slow_step_scores(q[:1], kc, bt[:1], lens[:1], width, scale,
                                                                        out=(lg[:1], nm[:1]))), 1)
        row["gpu"] = torch.cuda.get_device_name()
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fused-scores-h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
