"""Named attention policies for comparisons at equal token budgets (the quality suite).

Every policy runs in the SFI backend, chosen per request through ``SamplingParams(extra_args=
{"sfi": overrides})``; :func:`policy_overrides` builds those overrides for a retention (working-set
tokens / context tokens) at a context length.

* ``dense``: full attention every step.
* ``streaming``: StreamingLLM, sinks + a sliding window holding the whole budget.
* ``snapkv``: SnapKV-style: select once, at the first decode step, from that step's attention
  (evidence only, average-pooled over 7 positions), never refresh. (SnapKV proper selects from
  the last prompt queries during prefill; vLLM's prefix caching skips those queries, so the first
  decode query stands in for them.) New tokens join the window.
* ``quest``: Quest-style: at every step, pick the 16-token pages whose per-page key min/max bound
  ``q . k`` highest (per KV head, max over its query heads), within the budget.
* ``sfi`` and ablations: ``sfi-no-prior``, ``sfi-no-nms``, ``sfi-no-exclusivity``,
  ``sfi-interval`` (reuse budget only), ``sfi-boundary`` (sentence boundaries only), and
  ``sfi-wide-window`` (the window takes half the budget instead of a quarter: tests whether the
  split, not the Selector, decides prompt-end questions at small budgets), ``sfi-evidence-only``
  (no prior, no soft-NMS, no exclusivity) and ``sfi-smooth`` (SnapKV's 7-position pooling of the
  evidence added to SFI): diagnostics for where SFI's selection loses to SnapKV-style.
* ``sfi-pages`` (ours, not the paper's): SFI's Selector ranking 16-token pages by their fused
  mass instead of single tokens (``selector.page_size``), so soft-NMS spreads the budget across
  regions without thinning a multi-token answer written a digit per token.
"""

from __future__ import annotations

from typing import Any

SINKS = 4
MAX_WINDOW = 256
NO_LIMIT = 1 << 20

_POLICY: dict[str, dict[str, Any]] = {
    "dense": {"policy": "dense"},
    "streaming": {"policy": "streaming"},
    "snapkv": {"policy": "snapkv", "selector": {"alpha": 1.0, "use_prior": False, "use_nms": False,
                                                 "use_exclusivity": False, "smooth_kernel": 7}},
    "quest": {"policy": "quest"},
    "sfi": {"policy": "sfi"},
    "sfi-no-prior": {"policy": "sfi", "selector": {"use_prior": False}},
    "sfi-no-nms": {"policy": "sfi", "selector": {"use_nms": False}},
    "sfi-no-exclusivity": {"policy": "sfi", "selector": {"use_exclusivity": False}},
    "sfi-interval": {"policy": "sfi", "boundary_trigger": False},
    "sfi-boundary": {"policy": "sfi", "reuse_budget": NO_LIMIT},
    "sfi-wide-window": {"policy": "sfi"},
    "sfi-evidence-only": {"policy": "sfi", "selector": {"use_prior": False, "use_nms": False,
                                                       "use_exclusivity": False}},
    "sfi-smooth": {"policy": "sfi", "selector": {"smooth_kernel": 7}},
    "sfi-pages": {"policy": "sfi", "selector": {"page_size": 16}},
}
_WINDOW_SHARE = {"sfi-wide-window": 0.5}  # of the budget; every other selecting policy: 0.25
POLICIES = tuple(_POLICY)


def working_set(retention: float, context: int, window_share: float = 0.25) -> tuple[int, int, int]:
    """``(sinks, window, selected)`` tokens for a retention at a context length."""
    total = max(SINKS + 16, round(retention * context))
    window = max(16, min(MAX_WINDOW, int(total * window_share) // 16 * 16))
    return SINKS, window, max(0, total - SINKS - window)


def policy_overrides(policy: str, retention: float | None, context: int) -> dict[str, Any]:
    if policy not in _POLICY:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    over = {k: (dict(v) if isinstance(v, dict) else v) for k, v in _POLICY[policy].items()}
    if policy == "dense":
        return over
    if retention is None:
        raise ValueError(f"policy {policy!r} needs a retention")
    sinks, window, selected = working_set(retention, context, _WINDOW_SHARE.get(policy, 0.25))
    if policy == "streaming":
        window, selected = window + selected, 0
    over.update(sinks=sinks, recent_window=window, selected_tokens=selected)
    return over
