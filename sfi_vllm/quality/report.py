"""``sfi-vllm report``: a markdown table and a plot of score vs retention per policy from the
JSON lines that ``sfi-vllm eval`` writes."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (policy, retention): mean score over tasks and contexts, retrieval/aggregation means."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["retention"])].append(r)
    out = []
    for (pol, ret), items in groups.items():
        def mean(key, sel=lambda r: True):
            vals = [r[key] for r in items if sel(r) and r.get(key) is not None]
            return round(statistics.fmean(vals), 2) if vals else None
        out.append(dict(policy=pol, retention=ret, score=mean("score"),
                        retrieval=mean("score", lambda r: r["kind"] == "retrieval"),
                        aggregation=mean("score", lambda r: r["kind"] == "aggregation"),
                        measured_retention=mean("measured_retention"), slow_step_rate=mean("slow_step_rate"),
                        agree_tokens=mean("agree_tokens"), n=sum(r["n"] for r in items)))
    return sorted(out, key=lambda r: (r["retention"], r["policy"]))


def markdown(rows: list[dict], title: str, command: str | None = None) -> str:
    summ = summarize(rows)
    lines = [f"# {title}", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += ["Scores are percentages (RULER-style: share of expected strings found in the output).",
              "`retention` is the nominal working set (sinks + selected + window) over the context;",
              "`measured` is what fast steps attended on average (SFI's window grows between slow steps).",
              "`agree` is greedy tokens before the first divergence from dense on the same sample.", "",
              "| retention | policy | score | retrieval | aggregation | measured | slow-step rate | agree | n |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in summ:
        lines.append(f"| {r['retention']:.2f} | {r['policy']} | {r['score']} | {r['retrieval']} | {r['aggregation']} | "
                     f"{r['measured_retention']} | {r['slow_step_rate']} | {r['agree_tokens']} | {r['n']} |")
    lines += ["", "Per task (score, n per cell):", ""]
    tasks = sorted({r["task"] for r in rows})
    ctxs = sorted({r["context"] for r in rows})
    lines.append("| policy | retention | context | " + " | ".join(tasks) + " |")
    lines.append("|---|---|---|" + "---|" * len(tasks))
    cell = {(r["policy"], r["retention"], r["context"], r["task"]): r for r in rows}
    for s in summ:
        for c in ctxs:
            vals = []
            for t in tasks:
                r = cell.get((s["policy"], s["retention"], c, t))
                vals.append("-" if r is None else f"{r['score']:.0f} ({r['n']})")
            lines.append(f"| {s['policy']} | {s['retention']:.2f} | {c} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = summarize(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = [r for r in summ if r["policy"] == "dense"]
    for pol in sorted({r["policy"] for r in summ} - {"dense"}):
        pts = sorted((r["retention"], r["score"]) for r in summ if r["policy"] == pol)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol,
                linewidth=2.2 if pol == "sfi" else 1.2)
    if dense:
        ax.axhline(dense[0]["score"], color="black", linestyle="--", label="dense")
    ax.set_xlabel("retention (working-set tokens / context)")
    ax.set_ylabel("suite score (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(jsonl: str, prefix: str, title: str, command: str | None = None) -> None:
    rows = load(jsonl)
    Path(prefix + ".md").write_text(markdown(rows, title, command))
    plot(rows, prefix + ".png", title)
    print(f"wrote {prefix}.md and {prefix}.png")
