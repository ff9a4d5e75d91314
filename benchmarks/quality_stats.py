"""Per-request SFI statistics of a quality or fidelity run, per policy, retention and context.

    python benchmarks/quality_stats.py RAW.jsonl[.xz]        # prints a markdown table

RAW is the ``--raw`` file of ``sfi-vllm eval`` (one record per request). Columns, means over the
requests of a cell: generated tokens; decode steps that attended densely (the dense bridge, and
every step of a dense request), slow steps and fast steps; the share of the context the fast steps
attended (``fast attended``); slow steps per request by trigger, where the records carry them
(``slow_reasons``; "-" otherwise); and the share over all decode steps, dense and slow steps counting
the whole context (``decode attended``: what the request read of its KV cache on average).
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def table(records: list[dict]) -> str:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["policy"], r["retention"] if r["retention"] is not None else 1.0, r["context"])].append(r)
    lines = ["| context | retention | policy | requests | tokens | dense steps | slow steps | slow steps by trigger "
             "| fast steps | fast attended | decode attended |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else float("nan")

    for (pol, ret, ctx), rs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        dense = [r["decode_steps"] - r["fast_steps"] - r["slow_steps"] for r in rs]
        fast_att = [r["attended_fraction"] for r in rs if r["fast_steps"]]
        reasons: dict[str, int] = defaultdict(int)
        for r in rs:
            for name, count in (r.get("slow_reasons") or {}).items():
                reasons[name] += count
        by_trigger = ", ".join(f"{name} {count / len(rs):.2f}" for name, count in sorted(reasons.items())) or "-"
        lines.append(f"| {ctx} | {ret:.2f} | {pol} | {len(rs)} | {mean([r['out_tokens'] for r in rs]):.1f} "
                     f"| {mean(dense):.1f} | {mean([r['slow_steps'] for r in rs]):.2f} | {by_trigger} "
                     f"| {mean([r['fast_steps'] for r in rs]):.1f} | {mean(fast_att):.3f} "
                     f"| {mean([r.get('decode_attended_fraction') for r in rs]):.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table(load(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
