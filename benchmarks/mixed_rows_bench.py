"""The fast-step kernel on batches that mix fast and dense rows, with every row cut into the same
number of splits (the default) and with balanced splits (``experimental.balanced_splits``: each
row its share of the launch's programs, in proportion to its keys). One uniform launch under a CUDA
graph per case, at four decode points: every row fast (the default's 2,308-token working set),
one or two rows dense at the full context among fast rows (a slow row, a bridge row, a pool-full
fallback), and every row dense. Prints the time of both rules, their ratio, the bytes each case
reads over the time, and the largest difference between the two outputs. ``--engine-launch``
launches as the engine's CUDA backend does with its default settings: with a slot map
(double-buffered sets), the query staged for the per-step refresh, and fused score frames in
which no row is scored. Needs only torch and Triton (a CUDA GPU).

    python3 benchmarks/mixed_rows_bench.py [--engine-launch]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "kernels")]
import fast_decode as fd  # noqa: E402
from attn_timing import D, HKV, HQ, WINDOW, graph_time_us, row_kinds, setup  # noqa: E402

POINTS = ((16, 16384), (8, 32768), (6, 131072), (1, 131072))
WORKING_SET = 2308


def engine_extras(batch: int, q: torch.Tensor) -> dict:
    """The launch arguments of the engine's default CUDA path beside the bench's tables: an identity
    slot map, a query staging buffer and score frames with every row unscored (base -1)."""
    dev = q.device
    unscored = torch.full((batch,), -1, dtype=torch.int32, device=dev)
    one = torch.ones(batch, dtype=torch.int32, device=dev)
    buf = torch.zeros(16, dtype=torch.float32, device=dev)
    return dict(slot_map=torch.arange(batch, dtype=torch.int32, device=dev), stage=torch.empty_like(q),
                scores=fd.ScoreFrames(unscored, one, one, buf, buf, 0))


def point(batch: int, context: int, engine_launch: bool) -> None:
    kv, kc, vc, bt, q = setup(batch, context)
    (ck, cv, zeros, lens), kinds = row_kinds(batch, context, q, WORKING_SET)
    fast_slots, nc, ws, _ = kinds["fast"]
    extras = engine_extras(batch, q) if engine_launch else {}
    mixes = {"all fast": 0, "1 dense": 1, "2 dense": 2, "all dense": batch}
    out = torch.empty_like(q)
    for name, dense in mixes.items():
        if dense > batch or (name == "2 dense" and batch < 3):
            continue
        slots = fast_slots.clone()
        slots[:dense] = -1
        keys = [context] * dense + [WORKING_SET] * (batch - dense)
        nbytes = sum(keys) * HKV * D * 4
        results = {}
        for rule in ("equal", "balanced"):
            if rule == "equal":
                splits, per_row = fd.uniform_num_splits(batch, HKV), None
            else:
                splits = fd.balanced_num_splits(batch, HKV)
                per_row = torch.tensor(fd.balanced_row_splits(keys, HKV), dtype=torch.int32, device="cuda")
            w = fd.make_workspace(batch, HQ, D, splits, "cuda")

            def launch():
                fd.fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5, splits,
                                         out=out, workspace=w, row_splits=per_row, **extras)
            us = graph_time_us(launch, replays=50)
            results[rule] = (us, out.float().clone(), splits, per_row)
        (eq_us, eq_out, eq_s, _), (bal_us, bal_out, bal_s, per_row) = results["equal"], results["balanced"]
        err = (eq_out - bal_out).abs().max().item()
        counts = sorted(set(per_row.tolist()))
        print(f"{batch}x{context} {name:9s}: equal {eq_us:7.1f} us ({nbytes / eq_us / 1e6:.2f} TB/s, {eq_s} splits) | "
              f"balanced {bal_us:7.1f} us ({nbytes / bal_us / 1e6:.2f} TB/s, grid {bal_s}, rows {counts}) | "
              f"balanced/equal {bal_us / eq_us:.3f} | max diff {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-launch", action="store_true",
                    help="launch with the engine's slot map, query staging and (unscored) score frames")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name}, {props.multi_processor_count} SMs; "
          f"window {WINDOW}, working set {WORKING_SET}, engine launch {args.engine_launch}", flush=True)
    for batch, context in POINTS:
        point(batch, context, args.engine_launch)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
