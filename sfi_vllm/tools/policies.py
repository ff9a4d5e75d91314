"""Named attention policies for comparisons at equal token budgets (the quality suite).

Every policy runs in the SFI backend, chosen per request through ``SamplingParams(extra_args=
{"sfi": overrides})``; :func:`policy_overrides` builds those overrides for a retention (working-set
tokens / context tokens) at a context length, or for the engine's own budget (``retention`` 0 or
None: only the policy's own settings).

* ``dense``: full attention every step.
* ``streaming``: StreamingLLM, sinks + a sliding window holding the whole budget.
* ``snapkv``: SnapKV-style: select once, at the first decode step, from that step's attention
  (evidence only, average-pooled over 7 positions), never refresh. (SnapKV proper selects from
  the last prompt queries during prefill; vLLM's prefix caching skips those queries, so the first
  decode query stands in for them.) New tokens join the window.
* ``quest``: Quest-style: at every step, pick the 16-token pages whose per-page key min/max bound
  ``q . k`` highest (per KV head, max over its query heads), within the budget.
* ``sfi``: the engine's default SFI (16-token pages ranked by the slow step's evidence and the
  prior, the pages after a strong page kept with it, a dense bridge of the first decode steps; see
  ``SFIConfig``) and its ablations: ``sfi-no-bridge``, ``sfi-no-follow``, ``sfi-nms`` (page-level
  soft-NMS on), ``sfi-no-prior``, ``sfi-bridge-32``, ``sfi-selected-bridge`` (the bridge's steps
  attend through a provisional set: ``bridge_attention: selected``), ``sfi-interval`` (reuse budget only, no
  boundaries), ``sfi-boundary`` (boundaries only), ``sfi-dense-slow`` (slow steps attend densely, as
  the paper's do: ``slow_attention: dense``; the default's attend through the set they have),
  ``sfi-lockstep`` (``reuse_stagger`` off: requests that start together re-select together;
  ``sfi-stagger`` names the default's setting explicitly).
* ``sfi-paper``: the paper's Selector as published: token by token, soft-NMS, no bridge, no
  following pages, no reuse stagger, dense slow steps (the evidence normalised per query row over
  the candidates, and the lambda clip for several query rows under GQA, as the authors do);
  ``sfi-paper-no-nms`` without its soft-NMS.
"""

from __future__ import annotations

from typing import Any

SINKS = 4
MAX_WINDOW = 256
NO_LIMIT = 1 << 20

_PAPER_SELECTOR = {"page_size": 0, "use_nms": True, "use_prior": True, "use_exclusivity": True,
                   "follow_pages": 0}
_POLICY: dict[str, dict[str, Any]] = {
    "dense": {"policy": "dense"},
    "streaming": {"policy": "streaming"},
    "snapkv": {"policy": "snapkv", "selector": {"alpha": 1.0, "use_prior": False, "use_nms": False,
                                                 "use_exclusivity": False, "smooth_kernel": 7,
                                                 "page_size": 0, "follow_pages": 0}},
    "quest": {"policy": "quest"},
    "sfi": {"policy": "sfi"},
    "sfi-no-bridge": {"policy": "sfi", "bridge_steps": 0},
    "sfi-bridge-32": {"policy": "sfi", "bridge_steps": 32},
    "sfi-selected-bridge": {"policy": "sfi", "bridge_attention": "selected"},
    "sfi-no-follow": {"policy": "sfi", "selector": {"follow_pages": 0}},
    "sfi-nms": {"policy": "sfi", "selector": {"use_nms": True}},
    "sfi-no-prior": {"policy": "sfi", "selector": {"use_prior": False}},
    "sfi-interval": {"policy": "sfi", "boundary_trigger": False},
    "sfi-boundary": {"policy": "sfi", "reuse_budget": NO_LIMIT},
    "sfi-reuse-20": {"policy": "sfi", "boundary_trigger": False, "reuse_budget": 20},
    "sfi-stagger": {"policy": "sfi", "reuse_stagger": True},
    "sfi-lockstep": {"policy": "sfi", "reuse_stagger": False},
    "sfi-dense-slow": {"policy": "sfi", "slow_attention": "dense"},
    "sfi-paper": {"policy": "sfi", "bridge_steps": 0, "reuse_stagger": False, "slow_attention": "dense",
                  "selector": dict(_PAPER_SELECTOR)},
    "sfi-paper-no-nms": {"policy": "sfi", "bridge_steps": 0, "reuse_stagger": False, "slow_attention": "dense",
                         "selector": {**_PAPER_SELECTOR, "use_nms": False}},
}
_WINDOW_SHARE: dict[str, float] = {}  # of the budget; every selecting policy: 0.25
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
    if not retention:  # the engine's own working set
        return over
    sinks, window, selected = working_set(retention, context, _WINDOW_SHARE.get(policy, 0.25))
    if policy == "streaming":
        window, selected = window + selected, 0
    over.update(sinks=sinks, recent_window=window, selected_tokens=selected)
    return over
