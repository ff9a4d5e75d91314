"""Two `sfi-vllm fidelity --raw` files of the same documents, compared document by document.

    python3 benchmarks/paired_fidelity.py results/boundary-read-cpu-exact-raw.jsonl.xz \
        results/boundary-read-cpu-lagged-raw.jsonl.xz

For runs that differ in one engine setting (such as ``boundary_read``): it checks that dense's
reference continuations are the same in both, then prints per policy, retention and document the
teacher-forced top-1 agreement of each run, how many steps' top-1 outcome differs, the slow steps
and the mean KL, and per cell the mean of the paired top-1 differences with its 95% half-width
over documents (Student t), and the ratio of the mean KLs. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
from pathlib import Path

from sfi_vllm.tools.quality.fidelity import t975

def load(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", help="raw records of run A (.jsonl or .jsonl.xz)")
    ap.add_argument("b", help="raw records of run B")
    args = ap.parse_args()
    a, b = load(args.a), load(args.b)
    ref = {(r["context"], r["doc"]): r["token_ids"] for r in a if r["kind"] == "free-dense"}
    ref_b = {(r["context"], r["doc"]): r["token_ids"] for r in b if r["kind"] == "free-dense"}
    if ref.keys() != ref_b.keys() or any(ref[k] != ref_b[k] for k in ref):
        raise SystemExit("dense's reference continuations differ between the runs: not paired")
    forced = {}
    for run, recs in (("a", a), ("b", b)):
        for r in recs:
            if r["kind"] == "forced" and r["policy"] != "dense":
                forced.setdefault((r["policy"], r["retention"], r["context"], r["doc"]), {})[run] = r
    print(f"A: `{Path(args.a).name}`, B: `{Path(args.b).name}`; dense references identical "
          f"({len(ref)} documents)\n")
    print("| policy | retention | context | doc | top1 A | top1 B | steps differing | slow steps A / B | KL A | KL B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cells: dict = {}
    for key in sorted(forced):
        pair = forced[key]
        if set(pair) != {"a", "b"}:
            raise SystemExit(f"{key}: in one run only")
        ra, rb = pair["a"], pair["b"]
        ta, tb = statistics.mean(ra["top1"]), statistics.mean(rb["top1"])
        ka, kb = statistics.mean(ra["kl"]), statistics.mean(rb["kl"])
        diff = sum(x != y for x, y in zip(ra["top1"], rb["top1"]))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {100 * ta:.1f}% | {100 * tb:.1f}% | {diff} | "
              f"{ra['slow_steps']} / {rb['slow_steps']} | {ka:.3f} | {kb:.3f} |")
        c = cells.setdefault(key[:3], {"d": [], "ka": [], "kb": []})
        c["d"].append(100 * (tb - ta))
        c["ka"].append(ka)
        c["kb"].append(kb)
    print("\n| policy | retention | context | documents | top1 B - A (points) | mean KL B / A |")
    print("|---|---|---|---|---|---|")
    for key, c in sorted(cells.items()):
        n = len(c["d"])
        half = t975(n - 1) * statistics.stdev(c["d"]) / n ** 0.5 if n > 1 else float("nan")
        ratio = statistics.mean(c["kb"]) / statistics.mean(c["ka"])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {n} | {statistics.mean(c['d']):+.2f} ± {half:.2f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
