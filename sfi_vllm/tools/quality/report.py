"""``sfi-vllm report``: a markdown table and a plot of score vs retention per policy from the
JSON lines that ``sfi-vllm eval`` writes."""

from __future__ import annotations

import json
import math
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


def stratified_mean(items: list[dict]) -> tuple[float | None, float | None]:
    """Mean of the per-task scores of ``items`` (rows of one policy x context x retention; each task
    weighs the same) and its 95% half-width, ``1.96 sqrt(sum_t se_t^2) / T`` with ``se_t =
    ci95_t / 1.96`` (tasks are independent samples). The half-width is None if a task has no ci95
    (n = 1)."""
    if not items:
        return None, None
    mean = statistics.fmean(r["score"] for r in items)
    if any(r.get("ci95") is None for r in items):
        return round(mean, 2), None
    se = math.sqrt(sum((r["ci95"] / 1.96) ** 2 for r in items)) / len(items)
    return round(mean, 2), round(1.96 * se, 2)


def suite_means(rows: list[dict]) -> list[dict]:
    """Per (policy, context, retention): suite mean over tasks with its 95% half-width, the same for
    the retrieval tasks, the aggregation mean, and the samples per task (min and max)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["context"], r["retention"])].append(r)
    out = []
    for (pol, ctx, ret), items in groups.items():
        score, ci = stratified_mean(items)
        retr, retr_ci = stratified_mean([r for r in items if r["kind"] == "retrieval"])
        agg, agg_ci = stratified_mean([r for r in items if r["kind"] == "aggregation"])
        out.append(dict(policy=pol, context=ctx, retention=ret, score=score, ci95=ci, retrieval=retr,
                        retrieval_ci95=retr_ci, aggregation=agg, aggregation_ci95=agg_ci, tasks=len(items),
                        n_min=min(r["n"] for r in items), n_max=max(r["n"] for r in items)))
    return sorted(out, key=lambda r: (r["context"], r["retention"], r["policy"]))


def paired_differences(raw: list[dict], against: str = "sfi") -> list[dict]:
    """From per-request records (``eval --raw``): for each context, retention and policy P other
    than ``against``, the mean over tasks of the per-task mean of (score[against] - score[P]) on the
    same samples (dense: the dense run of that sample), in points, with its 95% half-width
    (stratified by task, as :func:`stratified_mean`)."""
    by_sample: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for p in raw:
        by_sample[(p["task"], p["context"], p["index"])][(p["policy"], p["retention"])] = 100 * p["score"]
    cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (task, ctx, _), scores in by_sample.items():
        for (pol, ret), sc in scores.items():
            if pol != against:
                continue
            for (pol2, ret2), sc2 in scores.items():
                if pol2 != against and (ret2 == ret or ret2 is None):
                    cells[(ctx, ret, pol2)][task].append(sc - sc2)
    out = []
    for (ctx, ret, pol2), per_task in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        means = [statistics.fmean(v) for v in per_task.values()]
        ses = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else None for v in per_task.values()]
        ci = None if any(x is None for x in ses) else round(1.96 * math.sqrt(sum(x * x for x in ses)) / len(ses), 2)
        out.append(dict(context=ctx, retention=ret, policy=pol2, diff=round(statistics.fmean(means), 2), ci95=ci,
                        tasks=len(means), n_min=min(len(v) for v in per_task.values())))
    return out


def _pm(x, ci) -> str:
    if x is None:
        return "-"
    return f"{x:.1f} ± {ci:.1f}" if ci is not None else f"{x:.1f}"


def markdown(rows: list[dict], title: str, command: str | None = None, raw: list[dict] | None = None) -> str:
    summ = summarize(rows)
    lines = [f"# {title}", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += ["Suite mean per policy, context and retention (each task weighs the same), ± the 95% "
              "half-width (normal approximation, stratified by task); `n` is samples per task.", "",
              "| context | retention | policy | suite | retrieval | aggregation | n |",
              "|---|---|---|---|---|---|---|"]
    for r in suite_means(rows):
        n = str(r["n_min"]) if r["n_min"] == r["n_max"] else f"{r['n_min']}-{r['n_max']}"
        lines.append(f"| {r['context']} | {r['retention']:.2f} | {r['policy']} | {_pm(r['score'], r['ci95'])} | "
                     f"{_pm(r['retrieval'], r['retrieval_ci95'])} | {_pm(r['aggregation'], r['aggregation_ci95'])} | {n} |")
    lines.append("")
    if raw:
        lines += ["SFI minus each policy on the same samples (paired; points, ± 95% half-width, stratified by "
                  "task; negative: SFI scores lower). Dense is compared at every retention.", "",
                  "| context | retention | SFI minus | difference | n per task |", "|---|---|---|---|---|"]
        for d in paired_differences(raw):
            lines.append(f"| {d['context']} | {d['retention']:.2f} | {d['policy']} | {_pm(d['diff'], d['ci95'])} | "
                         f"{d['n_min']} |")
        lines.append("")
    lines += ["Over all contexts:", ""]
    lines += ["Scores are percentages (RULER-style: share of expected strings found in the output).",
              "`retention` is the nominal working set (sinks + selected + window) over the context;",
              "`measured` is what fast steps attended on average (SFI's window grows between slow steps).",
              "`agree` is greedy tokens before the first divergence from dense on the same sample.", "",
              "| retention | policy | score | retrieval | aggregation | measured | slow-step rate | agree | n |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in summ:
        lines.append(f"| {r['retention']:.2f} | {r['policy']} | {r['score']} | {r['retrieval']} | {r['aggregation']} | "
                     f"{r['measured_retention']} | {r['slow_step_rate']} | {r['agree_tokens']} | {r['n']} |")
    lines += ["", "Per task (score ± 95% half-width, n per cell):", ""]
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
                vals.append("-" if r is None else f"{r['score']:.0f}" + (f" ± {r['ci95']:.0f}" if r.get("ci95") is not None else "")
                            + f" ({r['n']})")
            lines.append(f"| {s['policy']} | {s['retention']:.2f} | {c} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    """Suite mean (± 95% half-width) against retention, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = suite_means(rows)
    ctxs = sorted({r["context"] for r in summ})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5.5 * len(ctxs), 4.5), squeeze=False, sharey=True)
    for ax, ctx in zip(axes[0], ctxs):
        cs = [r for r in summ if r["context"] == ctx]
        dense = [r for r in cs if r["policy"] == "dense"]
        for pol in sorted({r["policy"] for r in cs} - {"dense"}):
            pts = sorted((r["retention"], r["score"], r["ci95"] or 0.0) for r in cs if r["policy"] == pol)
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=pol,
                        capsize=3, linewidth=2.2 if pol == "sfi" else 1.0)
        if dense:
            d = dense[0]
            ax.axhline(d["score"], color="black", linestyle="--", label="dense")
            if d["ci95"]:
                ax.axhspan(d["score"] - d["ci95"], d["score"] + d["ci95"], color="black", alpha=0.08)
        ax.set_xlabel("retention (working-set tokens / context)")
        ax.set_title(f"{ctx} tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("suite score (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(jsonl: str, prefix: str, title: str, command: str | None = None, raw: str | None = None) -> None:
    rows = load(jsonl)
    Path(prefix + ".md").write_text(markdown(rows, title, command, load(raw) if raw else None))
    plot(rows, prefix + ".png", title)
    print(f"wrote {prefix}.md and {prefix}.png")
