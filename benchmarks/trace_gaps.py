"""Where the GPU waits: idle gaps on the device timeline of a torch.profiler trace, and what the
host was doing during them.

    python3 benchmarks/trace_gaps.py TRACE.json[.gz] [--min-gap-us 20] [--top 30]

A decode step that is bound by the device keeps it busy from one kernel to the next; every
microsecond between kernels is the host's (scheduling, input preparation, Python in the runner or
the attention backend, a copy to the host that waits). The trace is torch.profiler's Chrome
export (``prof.export_chrome_trace``). Device activity: events of category ``kernel``,
``gpu_memcpy`` and ``gpu_memset`` on any stream, merged into busy intervals. Each gap of at least
``--min-gap-us`` between them is sampled every 2 us; a sample is charged to the innermost host
event running at that moment (a Python function with ``with_stack=True``, else an operator or a
``record_function`` scope), and inclusively to every ``record_function`` scope around it
(vLLM's ``gpu_model_runner: ...`` scopes with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``).

Gaps of ``--pause-ms`` or more (default 5 ms) are one-off pauses, not part of a step's rhythm: a
call's admission of its requests (prompt hashing, the prefix-cache lookup), a CUDA-graph capture.
They are listed, and left out of the attribution and of the busy share "between pauses".

Prints the window's busy share, the gaps by size, and the two attribution tables.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}


def load(path: str) -> list[dict]:
    p = Path(path)
    raw = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                   for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS)
    merged: list[list[float]] = []
    for s, t in spans:
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


def report(path: str, min_gap: float = 20.0, top: int = 30, pause_ms: float = 5.0) -> str:
    events = load(path)
    busy = busy_intervals(events)
    if not busy:
        return f"{path}: no device events"
    window = busy[-1][1] - busy[0][0]
    on = sum(t - s for s, t in busy)
    all_gaps = gaps_of(busy, 0.0)
    pauses = [g for g in all_gaps if g[1] - g[0] >= pause_ms * 1e3]
    gaps = [g for g in all_gaps if min_gap <= g[1] - g[0] < pause_ms * 1e3]
    idle_big = sum(t - s for s, t in gaps)
    paused = sum(t - s for s, t in pauses)
    lines = [f"# {path}",
             f"device window {window / 1e3:.1f} ms: busy {on / 1e3:.1f} ms ({100 * on / window:.1f}%), "
             f"idle {(window - on) / 1e3:.1f} ms",
             f"one-off pauses (>= {pause_ms:g} ms): {len(pauses)}, {paused / 1e3:.1f} ms"
             + "".join(f"; {(t - s) / 1e3:.1f} ms at +{(s - busy[0][0]) / 1e3:.1f}" for s, t in pauses[:8]),
             f"between pauses: busy {100 * on / max(window - paused, 1e-9):.1f}%, "
             f"{idle_big / 1e3:.1f} ms idle in {len(gaps)} gaps >= {min_gap:g} us"]
    edges = [20, 50, 100, 200, 500, 1000, 2000, 5000, float("inf")]
    hist = Counter()
    for s, t in all_gaps:
        d = t - s
        lo = 0
        for e in edges:
            if d < e:
                hist[(lo, e)] += d
                break
            lo = e
    lines.append("idle by gap size (us): " + ", ".join(
        f"[{lo}, {hi}): {v / 1e3:.1f} ms" for (lo, hi), v in sorted(hist.items())))
    inner, scopes = attribute(events, gaps)
    lines.append(f"\n## idle time by innermost host event (gaps >= {min_gap:g} us), ms")
    lines += [f"{v / 1e3:9.2f}  {k}" for k, v in inner.most_common(top)]
    lines.append("\n## idle time inside record_function scopes (inclusive), ms")
    lines += [f"{v / 1e3:9.2f}  {k}" for k, v in scopes.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--pause-ms", type=float, default=5.0)
    args = ap.parse_args()
    print(report(args.trace, args.min_gap_us, args.top, args.pause_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
