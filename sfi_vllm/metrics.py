"""SFI's Prometheus metrics, exported by the worker that plans the steps (the rank-0 worker).

vLLM serves ``/metrics`` from its API-server process, and SFI's figures are made in a worker
process (the engine core's, or a worker under tensor parallelism). They meet through
prometheus_client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty
directory in the environment the server starts in, every process writes its metric values to
files there, and vLLM's ``/metrics`` reads them all (``vllm.v1.metrics.prometheus``: a
``MultiProcessCollector`` whenever the variable is set). prometheus_client picks the file-backed
values when it is imported, so the variable must be set before the server starts; the plugin
cannot set it later. Without it the metrics exist only in the worker process's own registry (an
offline ``LLM`` in one process can read them there; a server's ``/metrics`` does not show them),
and the worker says so once at start-up.

Counts are per request-step (one row of one engine step): a step with 8 decode rows, 7 fast and
one slow, adds 7 to ``sfi_fast_steps_total`` and 1 to ``sfi_slow_steps_total``. They are
collected in :class:`~sfi_vllm.stats.StatsRegistry` (the per-request statistics come from the
same calls) and written once per engine step.
"""

from __future__ import annotations

import logging
import os
from collections import Counter as Tally

logger = logging.getLogger("sfi_vllm")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 0.9, 1.0)
SECONDS_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)

_METRICS: "SFIMetrics | None" = None


class SFIMetrics:
    """The metric objects (one set per process: prometheus_client refuses a name twice)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("sfi_requests", "Requests the SFI worker served to the end (finished "
                                "or aborted), by the policy they ran", ["policy"])
        self.fallbacks = Counter("sfi_request_fallbacks", "Requests that ran with dense attention "
                                 "instead of the SFI settings they asked for, by reason", ["reason"])
        self.prefill_steps = Counter("sfi_prefill_steps", "Request-steps that prefilled (a prompt chunk)")
        self.dense_steps = Counter("sfi_dense_steps", "Decode request-steps run densely (the dense bridge of "
                                   "the first decode steps, policy dense, a context below "
                                   "dense_below_context, or a fallback)")
        self.fast_steps = Counter("sfi_fast_steps", "Decode request-steps that attended to the "
                                  "working set only (sinks, selected tokens, recent window)")
        self.slow_steps = Counter("sfi_slow_steps", "Decode request-steps that re-selected (scored every "
                                  "key; attended densely, or through the set they had with "
                                  "slow_attention keys), by what triggered them", ["reason"])
        self.verify_steps = Counter("sfi_verify_steps", "sfi.mode lossless: request-steps in which the "
                                    "model verified drafted tokens with dense attention")
        self.drafted_tokens = Counter("sfi_drafted_tokens", "sfi.mode lossless: tokens the SFI drafter "
                                      "proposed and the model verified")
        self.accepted_tokens = Counter("sfi_accepted_tokens", "sfi.mode lossless: drafted tokens the "
                                       "model accepted (accepted / verify steps + 1: tokens per verify step)")
        self.preemptions = Counter("sfi_preemptions", "Preemptions of SFI requests (their state is "
                                   "reset and rebuilt from the prefill)")
        self.attended = Counter("sfi_fast_attended_tokens", "Tokens attended by fast steps, summed over "
                                "fast request-steps and layers (GPU kernel path: over fast request-steps, except Quest-style "
                                "rows, counted per layer; attended / context is the attended fraction either way)")
        self.context = Counter("sfi_fast_context_tokens", "The contexts those fast steps stood for, "
                               "summed the same way as sfi_fast_attended_tokens_total")
        self.fast_evals = Counter("sfi_fast_layer_evaluations", "Fast (request-step, layer) evaluations "
                                  "behind the two sums above; attended / evaluations is the mean "
                                  "working set of a fast step")
        self.attended_fraction = Histogram("sfi_request_attended_fraction", "Per served request with "
                                           "fast steps: tokens attended by its fast steps over their "
                                           "contexts", buckets=FRACTION_BUCKETS)
        self.selection_seconds = Histogram("sfi_selection_seconds", "Selection and repack of one "
                                           "layer's slow rows: host-timed on the CPU reference path, "
                                           "timed by CUDA events on the GPU kernel path (a per-step "
                                           "refresh of every layer counts as that many layers, each "
                                           "its share)", buckets=SECONDS_BUCKETS)
        self.graph_runs = Counter("sfi_cuda_graph_runs", "GPU kernel path: how the work that SFI "
                                  "captures in CUDA graphs of its own ran, by what (selection: a slow "
                                  "step's selection and repack, one run per step and shape with the "
                                  "per-step refresh, one per layer with the per-layer refresh; drafter: "
                                  "sfi.mode lossless, a drafter pass that drafter_graphs may run as a "
                                  "graph) and how (replay: a captured graph; capture: a new graph "
                                  "captured, which synchronises the device; eager: without one, for "
                                  "a shape not yet used often enough or a pass the graph cannot serve)",
                                  ["what", "how"])
        # mostrecent, as vLLM's own gauges: only the planning worker writes them (vLLM marks no
        # engine process dead, so a "live" mode would not drop a stale file either)
        self.compact_sets = Gauge("sfi_compact_sets", "Compact sets the pool holds: requests that can "
                                  "run an SFI policy at once (sfi.compact_memory_gib)",
                                  multiprocess_mode="mostrecent")
        self.compact_sets_in_use = Gauge("sfi_compact_sets_in_use", "Compact sets held by requests the "
                                         "worker has not retired (it retires a request at the first step "
                                         "the engine runs after the request ends); a "
                                         "request that runs densely takes one only where no other slot is "
                                         "free", multiprocess_mode="mostrecent")
        self._start_label_values()
        if not os.environ.get(MULTIPROC_ENV):
            logger.info("sfi-vllm: %s is not set, so SFI's metrics stay in this process: a server's "
                        "/metrics shows them only when the server starts with it set to an empty "
                        "directory", MULTIPROC_ENV)

    def _start_label_values(self) -> None:
        """Create every known label value at 0, so that ``/metrics`` lists each series from the
        start (prometheus_client shows a labelled series only once it has been touched): a
        dashboard or alert on ``sfi_request_fallbacks_total`` reads 0, not "no data", until the
        first fallback. Label values that only appear with a setting (the Selector's graph runs)
        are left to their first use."""
        from typing import get_args

        from sfi_vllm.config import SFIConfig
        from sfi_vllm.stats import FALLBACK_REASONS, REASON_NAMES

        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        for reason in REASON_NAMES.values():
            self.slow_steps.labels(reason=reason)
        for policy in get_args(SFIConfig.model_fields["policy"].annotation):
            self.requests.labels(policy=policy)

    def write(self, steps: Tally, fast_sums: list[int]) -> None:
        """Add one engine step's tallies: ``steps`` keyed by ("prefill" | "dense" | "fast" |
        "preempted" | "verify" | "drafted" | "accepted", None) or ("slow", reason); ``fast_sums`` = [attended, context, evaluations]."""
        for (kind, label), n in steps.items():
            if kind == "fast":
                self.fast_steps.inc(n)
            elif kind == "slow":
                self.slow_steps.labels(reason=label).inc(n)
            elif kind == "dense":
                self.dense_steps.inc(n)
            elif kind == "prefill":
                self.prefill_steps.inc(n)
            elif kind == "preempted":
                self.preemptions.inc(n)
            elif kind == "verify":
                self.verify_steps.inc(n)
            elif kind == "drafted":
                self.drafted_tokens.inc(n)
            elif kind == "accepted":
                self.accepted_tokens.inc(n)
        if fast_sums[2]:
            self.attended.inc(fast_sums[0])
            self.context.inc(fast_sums[1])
            self.fast_evals.inc(fast_sums[2])


def worker_metrics() -> SFIMetrics:
    """This process's metrics, created on first use."""
    global _METRICS
    if _METRICS is None:
        _METRICS = SFIMetrics()
    return _METRICS
