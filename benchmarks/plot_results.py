"""Plots of the committed GPU results (no measurement): kernel speedup vs retention and end-to-end
ratios vs the achievable ones.

    python benchmarks/plot_results.py    # writes benchmarks/results/{kernel,e2e,e2e-keys}-h200.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PAPER = {0.016: 10.67, 0.063: 9.56, 0.125: 7.15, 0.25: 3.96, 0.375: 2.75, 0.5: 2.10, 0.75: 1.43, 0.984: 1.10}
TARGETS = {(1, 131072): 2.0, (16, 16384): 2.2, (8, 32768): 2.5, (6, 131072): 9.0}


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def kernel_plot() -> None:
    rows = [r for r in _rows("kernel-h200.jsonl") if r.get("batch") == 16 and "speedup" in r]
    rows.sort(key=lambda r: r["retention"])
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([100 * r["retention"] for r in rows], [r["speedup"] for r in rows], "o-", label="SFI fast-step kernel")
    ax.plot([100 * r["retention"] for r in rows], [r["dense_us"] / r["fa3_same_bytes_us"] for r in rows], "s--",
            label="FA3 on the same bytes")
    ax.plot([100 * k for k in PAPER], list(PAPER.values()), "x:", label="paper (7.15x at 12.5%)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("retention (% of the 16K context attended)")
    ax.set_ylabel("speedup vs FA3 dense decode")
    ax.set_title("H200, batch 16 x 16K, Qwen3-4B attention shape, CUDA graphs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kernel-h200.png", dpi=120)


def e2e_plot() -> None:
    """Measured ratio per point for each slow-step refresh mode in e2e-h200.jsonl (rows without a
    ``slow_refresh`` field count as per layer; where a mode ran a point more than once, the file's
    last row, the latest run, is drawn), and the achievable ratio of the per-layer run."""
    rows = _rows("e2e-h200.jsonl")
    points = sorted({(r["context"], r["batch"]) for r in rows})
    modes = sorted({r.get("slow_refresh", "per_layer") for r in rows})
    by = {(r.get("slow_refresh", "per_layer"), r["context"], r["batch"]): r for r in rows}
    labels = [f"{b}x{c // 1024}K" for c, b in points]
    width = 0.8 / (len(modes) + 1)
    fig, ax = plt.subplots(figsize=(10, 5))
    for m, mode in enumerate(modes):
        ax.bar([i - 0.4 + (m + 0.5) * width for i in range(len(points))],
               [by[(mode, c, b)]["ratio"] if (mode, c, b) in by else 0 for c, b in points], width,
               color=plt.get_cmap("tab20")(m % 20), label=f"measured, {mode.replace('_', ' ')}")
    ach = "per_layer" if "per_layer" in modes else modes[0]
    ax.bar([i - 0.4 + (len(modes) + 0.5) * width for i in range(len(points))],
           [by[(ach, c, b)]["achievable_ratio"] if (ach, c, b) in by else 0 for c, b in points], width,
           color="white", edgecolor="black", hatch="//", label=f"achievable ({ach.replace('_', ' ')} run)")
    for i, (c, b) in enumerate(points):
        t = TARGETS.get((b, c))
        if t:
            ax.plot([i - 0.4, i + 0.4], [t, t], "k--", lw=1)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(range(len(points))), labels)
    ax.set_ylabel("SFI / dense decode tok/s")
    ax.set_title("H200 end to end (dashed: issue targets; 5.5% slow steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "e2e-h200.png", dpi=120)


def keys_plot() -> None:
    """e2e-h200-keys.jsonl: per point, SFI against dense decode tok/s for each of its engines (the
    calls' ``call`` labels), dense from the calls that ran it, and the slow step against a dense
    step derived from each engine's plain and probe runs."""
    rows = _rows("e2e-h200-keys.jsonl")
    dense = {(r["batch"], r["context"]): r["dense_tok_s"] for r in rows if "dense_tok_s" in r}
    runs = [r for r in rows if "sfi_tok_s" in r]
    engines = {"call 1": "dense slow steps", "call 2": "keys-only", "call 3": "keys-only, per-step refresh"}
    points = sorted(dense, key=lambda p: (p[1], p[0]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(engines)
    for e, (call, label) in enumerate(engines.items()):
        ratio, slow = [], []
        for b, c in points:
            r = next((r for r in runs if r["call"].startswith(call) and (r["batch"], r["context"]) == (b, c)), None)
            if r is None:
                ratio.append(0)
                slow.append(0)
                continue
            ratio.append(r["sfi_tok_s"] / dense[(b, c)])
            t1, t2 = b / r["sfi_tok_s"], b / r["sfi_probe_tok_s"]
            r1, r2 = r["sfi_slow_step_rate"], r["sfi_probe_slow_step_rate"]
            d = (t2 - t1) / (r2 - r1)
            slow.append((t1 - r1 * d + d) / (b / dense[(b, c)]))
        xs = [i - 0.4 + (e + 0.5) * width for i in range(len(points))]
        ax.bar(xs, ratio, width, label=label, color=plt.get_cmap("tab10")(e))
        ax2.bar(xs, slow, width, label=label, color=plt.get_cmap("tab10")(e))
    for i, (b, c) in enumerate(points):
        if (b, c) in TARGETS:
            ax.plot([i - 0.4, i + 0.4], [TARGETS[(b, c)]] * 2, "k--", lw=1)
    labels = [f"{b}x{c // 1024}K" for b, c in points]
    ax.set_xticks(list(range(len(points))), labels)
    ax2.set_xticks(list(range(len(points))), labels)
    ax.set_ylabel("SFI / dense decode tok/s")
    ax.set_title("H200, speed preset, 5.5% slow steps (dashed: targets)")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("slow step / dense step")
    ax2.set_title("slow step, derived from plain and probe runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "e2e-keys-h200.png", dpi=120)


if __name__ == "__main__":
    kernel_plot()
    e2e_plot()
    keys_plot()
    print("wrote", RESULTS / "kernel-h200.png", RESULTS / "e2e-h200.png", RESULTS / "e2e-keys-h200.png")
