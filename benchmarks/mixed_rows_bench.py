"""The fast-step kernel on batches that mix fast and dense rows, with every row cut into the same
number of splits (``sfi.balanced_splits: false``) and with balanced splits (``balanced_splits``,
the engine's default: each row its share of the launch's programs, in proportion to its keys). One uniform launch under a CUDA
graph per case, at four decode points by default (``--points``): every row fast (the default's 2,308-token working set),
one or two rows dense at the full context among fast rows (a slow row, a bridge row, a pool-full
fallback), and every row dense. Prints the time of both rules, their ratio, the bytes each case
reads over the time, and the largest difference between the two outputs. ``--engine-launch``
launches as the engine's CUDA backend does with its default settings: with a slot map
(double-buffered sets), the query staged for the per-step refresh, and fused score frames, and
adds two cases: one or two fast rows scored over their whole context (keys-only slow rows, whose
score pass reads every key of the context; the two rules' attention outputs are compared, not
their scores). ``--extras`` passes only some of those arguments. Each compiled variant's registers
and spills are printed as Triton reports them (spills in 4-byte words). Needs only torch and
Triton (a CUDA GPU).

    python3 benchmarks/mixed_rows_bench.py [--engine-launch [--extras slot_map,stage,scores]] [--points 16x16384,...]
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


EXTRAS = ("slot_map", "stage", "scores")


def engine_extras(batch: int, context: int, q: torch.Tensor, scored: int = 0, keep=EXTRAS) -> dict:
    """The launch arguments of the engine's default CUDA path beside the bench's tables: an identity
    slot map, a query staging buffer and score frames in which the first ``scored`` rows are scored
    over ``context`` keys (a frame of their own each, one layer) and the others not (base -1)."""
    dev = q.device
    base = torch.full((batch,), -1, dtype=torch.int32, device=dev)
    width = torch.ones(batch, dtype=torch.int32, device=dev)
    if scored:
        base[:scored] = torch.arange(scored, dtype=torch.int32, device=dev) * context
        width[:scored] = context
    logits = torch.zeros(max(16, scored * context * HQ), dtype=torch.float32, device=dev)
    norms = torch.zeros(max(16, scored * context * HKV), dtype=torch.float32, device=dev)
    extras = dict(slot_map=torch.arange(batch, dtype=torch.int32, device=dev), stage=torch.empty_like(q),
                  scores=fd.ScoreFrames(base, width, width, logits, norms, 0))
    return {k: v for k, v in extras.items() if k in keep}


def compiled_kernels() -> dict:
    """id -> (registers, spills) of every compiled variant of the split kernel (Triton's JIT cache;
    empty where this Triton version keeps it elsewhere)."""
    out = {}
    for caches in getattr(fd._fast_decode_split, "device_caches", {}).values():
        for cache in (c for c in caches if isinstance(c, dict)):
            for kernel in cache.values():
                regs = getattr(kernel, "n_regs", None)
                if regs is not None:
                    out[id(kernel)] = (regs, getattr(kernel, "n_spills", None))
    return out


def point(batch: int, context: int, engine_launch: bool, keep=EXTRAS) -> None:
    kv, kc, vc, bt, q = setup(batch, context)
    (ck, cv, zeros, lens), kinds = row_kinds(batch, context, q, WORKING_SET)
    fast_slots, nc, ws, _ = kinds["fast"]
    # name: (dense rows, scored fast rows); the rows come first in the batch
    mixes = {"all fast": (0, 0), "1 dense": (1, 0), "2 dense": (2, 0), "all dense": (batch, 0)}
    if engine_launch and "scores" in keep:
        mixes.update({"1 scored": (0, 1), "2 scored": (0, 2)})
    out = torch.empty_like(q)
    for name, (dense, scored) in mixes.items():
        if dense > batch or scored > batch or (name.startswith("2 ") and batch < 3):
            continue
        extras = engine_extras(batch, context, q, scored, keep) if engine_launch else {}
        slots = fast_slots.clone()
        slots[:dense] = -1
        # the keys each row reads, as row_keys counts them: a scored row's pass over its context
        # reads the keys without the values
        keys = ([context] * dense + [WORKING_SET + context // 2] * scored
                + [WORKING_SET] * (batch - dense - scored))
        nbytes = sum(keys) * HKV * D * 4
        results = {}
        for rule in ("equal", "balanced"):
            if rule == "equal":
                splits, per_row = fd.uniform_num_splits(batch, HKV), None
            else:
                splits = fd.balanced_num_splits(batch, HKV)
                per_row = torch.tensor(fd.balanced_row_splits(keys, HKV), dtype=torch.int32, device="cuda")
            w = fd.make_workspace(batch, HQ, D, splits, "cuda")
            before = compiled_kernels()

            def launch():
                fd.fast_decode_attention(q, ck, cv, kc, vc, bt, slots, zeros, lens, nc, ws, D ** -0.5, splits,
                                         out=out, workspace=w, row_splits=per_row, **extras)
            us = graph_time_us(launch, replays=50)
            new = {k: v for k, v in compiled_kernels().items() if k not in before}
            if new:
                print(f"  compiled for {rule} at {batch}x{context}: (registers, spills) {sorted(new.values())}")
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
                    help="launch with the engine's slot map, query staging and score frames")
    ap.add_argument("--extras", default=None,
                    help="with --engine-launch, which of the engine's launch arguments to pass, comma-separated "
                         f"among {','.join(EXTRAS)} (default: all three; '' for none)")
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxC,...")
    args = ap.parse_args()
    if args.extras is not None and not args.engine_launch:
        ap.error("--extras needs --engine-launch")
    keep = EXTRAS if args.extras is None else tuple(e for e in args.extras.split(",") if e)
    if not set(keep) <= set(EXTRAS):
        ap.error(f"--extras: choose among {', '.join(EXTRAS)}")
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, {props.name}, {props.multi_processor_count} SMs; "
          f"window {WINDOW}, working set {WORKING_SET}, engine launch {args.engine_launch}"
          f"{' (' + ','.join(keep) + ')' if args.engine_launch else ''}", flush=True)
    for batch, context in (map(int, p.split("x")) for p in args.points.split(",")):
        point(batch, context, args.engine_launch, keep)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
