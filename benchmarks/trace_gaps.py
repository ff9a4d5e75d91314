"""Where the GPU waits: idle gaps on the device timeline of a torch.profiler trace, what the host
was doing during them, and what the device did.

    python3 benchmarks/trace_gaps.py TRACE.json[.gz] [--from-ms A] [--to-ms B] [--kernels]
        [--min-gap-us 20] [--pause-ms 5] [--top 30]

A decode step that is bound by the device keeps it busy from one kernel to the next; every
microsecond between kernels is the host's (scheduling, input preparation, Python in the runner or
the attention backend, a copy to the host that waits). The trace is torch.profiler's Chrome
export (``prof.export_chrome_trace``; ``profile_engine.py --trace`` writes them). Device activity:
events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``, on every stream and device,
merged into one busy timeline. ``--from-ms`` / ``--to-ms`` restrict everything to a window, in
milliseconds from the first device event (the figures' ``+ms``), e.g. whole engine steps.

* **Busy share and gaps.** Gaps of ``--pause-ms`` or more (default 5 ms) are one-off pauses, not
  part of a step's rhythm (a call's admission of its requests, a CUDA-graph capture): listed, and
  left out of the attribution and of the busy share "between pauses".
* **Attribution.** Each gap of at least ``--min-gap-us`` is sampled every 2 us (a gap's last
  partial 2 us are not sampled); a sample is charged to the innermost host event running then,
  on any host thread (a Python function with ``with_stack=True``, else an operator or a
  ``record_function`` scope), and inclusively to every ``record_function`` scope around it
  (vLLM's ``gpu_model_runner: ...`` scopes with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``).
* **Engine steps**: the offsets at which the host launched each model forward (vLLM's
  ``gpu_model_runner: forward`` scope), to choose a window of whole steps (the device runs each
  step a little after its launch, so a window of many steps is what is exact, not each step).
* **Idle per scope** (exact, every gap size): for each vLLM runner scope name, its wall time in
  the window and the time inside it with no device activity.
* **Kernels** (``--kernels``): device time by kernel group (:data:`KERNEL_GROUPS`, first match
  of a name), with launches and the median launch time; the groups of SFI's kernels also list
  launches above 5x their median apart (e.g. the fast-step kernel's dense rows).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}
# (group, substrings of the kernel name): the first group with a matching substring takes a kernel
KERNEL_GROUPS = (
    ("SFI fast-step kernel", ("_fast_decode_split", "_merge_splits")),
    ("SFI re-selection", ("_slow_scores", "_stats_", "_fused_log_s", "_nms_exclusivity", "_top_k",
                          "_repack", "indexSelect")),
    ("KV-cache writes", ("reshape_and_cache",)),
    ("FlashAttention", ("flash",)),  # its attention (cutlass::device_kernel<flash::...>) and metadata
    ("matrix products", ("nvjet", "gemm", "Gemm", "cutlass", "splitKreduce")),
    ("torch.compile kernels", ("triton_",)),
    ("copies and fills", ("Memcpy", "Memset", "copy_kernel", "elementwise_kernel")),
)


def load(path: str) -> list[dict]:
    p = Path(path)
    raw = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]


def busy_intervals(events: list[dict], lo: float = float("-inf"), hi: float = float("inf")
                   ) -> list[tuple[float, float]]:
    """The device's busy intervals (absolute us), merged, clipped to ``[lo, hi)``."""
    spans = sorted((max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e.get("dur", 0))))
                   for e in device_events(events))
    merged: list[list[float]] = []
    for s, t in spans:
        if t <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def gaps_of(busy: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    return [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)
            if busy[i + 1][0] - busy[i][1] >= min_gap]


def attribute(events: list[dict], gaps: list[tuple[float, float]], step: float = 2.0
              ) -> tuple[Counter, Counter]:
    """(innermost host event name -> us, record_function scope name -> us) over the gaps' samples."""
    host = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("cat"), e.get("name", "?"))
                   for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS), key=lambda x: x[0])
    starts = [h[0] for h in host]
    samples = [s + step * (k + 0.5) for s, t in gaps for k in range(int((t - s) // step))]
    inner: Counter = Counter()
    scopes: Counter = Counter()
    active: list[tuple[float, float, str, str]] = []
    nxt = 0
    for t in samples:  # samples ascend: events start at most once into the active list
        hi = bisect.bisect_right(starts, t)
        active.extend(host[nxt:hi])
        nxt = max(nxt, hi)
        active = [h for h in active if h[1] > t]
        if not active:
            inner["(no host event)"] += step
            continue
        innermost = min(active, key=lambda h: h[1] - h[0])
        inner[f"{innermost[3]} [{innermost[2]}]"] += step
        for name in {h[3] for h in active if h[2] == "user_annotation"}:
            scopes[name] += step
    return inner, scopes


def busy_within(busy: list[tuple[float, float]], a: float, b: float) -> float:
    starts = [s for s, _ in busy]
    i = max(0, bisect.bisect_right(starts, a) - 1)
    total = 0.0
    while i < len(busy) and busy[i][0] < b:
        s, t = busy[i]
        total += max(0.0, min(t, b) - max(s, a))
        i += 1
    return total


def scope_idle(events: list[dict], busy: list[tuple[float, float]], lo: float, hi: float,
               prefix: str = "gpu_model_runner:") -> dict[str, tuple[int, float, float]]:
    """Per runner scope name: (occurrences, wall us, us with no device activity), within the window."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(prefix):
            a, b = max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e.get("dur", 0)))
            if b > a:
                row = out[e["name"]]
                row[0] += 1
                row[1] += b - a
                row[2] += (b - a) - busy_within(busy, a, b)
    return {k: (int(v[0]), v[1], v[2]) for k, v in out.items()}


def kernel_groups(events: list[dict], lo: float, hi: float) -> list[tuple[str, float, int, float, int, float]]:
    """(group, us, launches, median us, launches above 5x the median, their us) per kernel group,
    for the kernels that start in ``[lo, hi)``; largest first."""
    durs: dict[str, list[float]] = defaultdict(list)
    for e in device_events(events):
        if lo <= float(e["ts"]) < hi:
            name = e.get("name", "?")
            group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")
            durs[group].append(float(e.get("dur", 0)))
    rows = []
    for group, ds in durs.items():
        med = statistics.median(ds)
        long_ = [d for d in ds if d > 5 * med] if group.startswith("SFI") else []
        rows.append((group, sum(ds), len(ds), med, len(long_), sum(long_)))
    return sorted(rows, key=lambda r: -r[1])


def report(path: str, min_gap: float = 20.0, top: int = 30, pause_ms: float = 5.0,
           from_ms: float | None = None, to_ms: float | None = None, kernels: bool = False) -> str:
    events = load(path)
    full = busy_intervals(events)
    if not full:
        return f"{path}: no device events"
    t0 = full[0][0]
    lo = t0 + from_ms * 1e3 if from_ms is not None else t0
    hi = t0 + to_ms * 1e3 if to_ms is not None else full[-1][1]
    busy = busy_intervals(events, lo, hi)
    window = hi - lo
    on = sum(t - s for s, t in busy)
    edges = [lo] + [x for iv in busy for x in iv] + [hi]
    all_gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    pauses = [g for g in all_gaps if g[1] - g[0] >= pause_ms * 1e3]
    gaps = [g for g in all_gaps if min_gap <= g[1] - g[0] < pause_ms * 1e3]
    idle_big = sum(t - s for s, t in gaps)
    paused = sum(t - s for s, t in pauses)
    lines = [f"# {path}, window +{(lo - t0) / 1e3:.1f} to +{(hi - t0) / 1e3:.1f} ms",
             f"device window {window / 1e3:.1f} ms: busy {on / 1e3:.1f} ms ({100 * on / window:.1f}%), "
             f"idle {(window - on) / 1e3:.1f} ms",
             f"one-off pauses (>= {pause_ms:g} ms): {len(pauses)}, {paused / 1e3:.1f} ms"
             + "".join(f"; {(t - s) / 1e3:.1f} ms at +{(s - t0) / 1e3:.1f}" for s, t in pauses[:8]),
             f"between pauses: busy {100 * on / max(window - paused, 1e-9):.1f}%, "
             f"{idle_big / 1e3:.1f} ms idle in {len(gaps)} gaps >= {min_gap:g} us"]
    bounds = [0, 20, 50, 100, 200, 500, 1000, 2000, 5000, float("inf")]
    hist: Counter = Counter()
    for s, t in all_gaps:
        d = t - s
        k = next(i for i in range(1, len(bounds)) if d < bounds[i])
        hist[(bounds[k - 1], bounds[k])] += d
    lines.append("idle by gap size (us): " + ", ".join(
        f"[{a}, {b}): {v / 1e3:.1f} ms" for (a, b), v in sorted(hist.items())))
    inner, scopes = attribute(events, gaps)
    lines.append(f"\n## idle time by innermost host event (gaps >= {min_gap:g} us), ms")
    lines += [f"{v / 1e3:9.2f}  {k}" for k, v in inner.most_common(top)]
    lines.append(f"\n## idle time inside record_function scopes (inclusive, gaps >= {min_gap:g} us), ms")
    lines += [f"{v / 1e3:9.2f}  {k}" for k, v in scopes.most_common(top)]
    forwards = sorted(float(e["ts"]) for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                      and e.get("name") == "gpu_model_runner: forward")
    if forwards:  # the engine steps' launches: windows of whole steps start and end at these
        lines.append("\n## engine steps: host launch of each model forward (gpu_model_runner: forward), "
                     "+ms: " + " ".join(f"{(f - t0) / 1e3:.2f}" for f in forwards[:120]))
    per_scope = scope_idle(events, busy, lo, hi)
    if per_scope:
        lines.append("\n## vLLM runner scopes in the window (every gap): count, wall ms, device-idle ms")
        lines += [f"{n:5d} {w / 1e3:9.2f} {i / 1e3:9.2f}  {k}"
                  for k, (n, w, i) in sorted(per_scope.items(), key=lambda kv: -kv[1][2])]
    if kernels:
        lines.append("\n## device time by kernel group (kernels starting in the window): ms, launches, "
                     "median us; SFI groups: launches above 5x the median, their ms")
        for group, us, n, med, n_long, us_long in kernel_groups(events, lo, hi):
            extra = f"; {n_long} above 5x median: {us_long / 1e3:.2f} ms" if n_long else ""
            lines.append(f"{us / 1e3:9.2f} {n:7d} {med:8.1f}  {group}{extra}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pause-ms", type=float, default=5.0)
    ap.add_argument("--from-ms", type=float, default=None, help="window start, ms after the first device event")
    ap.add_argument("--to-ms", type=float, default=None, help="window end, ms after the first device event")
    ap.add_argument("--kernels", action="store_true", help="device time by kernel group")
    args = ap.parse_args()
    print(report(args.trace, args.min_gap_us, args.top, args.pause_ms, args.from_ms, args.to_ms, args.kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
