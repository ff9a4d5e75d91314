"""sfi.mode lossless: SFI drafts, the model verifies with dense attention.

The engine runs vLLM's ``draft_model`` speculative decoding with the served checkpoint as its own
drafter. The model's layers attend densely (they verify); SFI attends in the drafter's layers only.
Per engine step, in this order:

1. the model's step: every row dense; a decode row holds the last sampled token and the ``k``
   tokens drafted for it, and vLLM's rejection sampler keeps the longest prefix the model agrees
   with plus one token of its own (:meth:`SFIController._plan_verify` plans it);
2. the drafter's first pass: with ``drafter_kv: shared`` each row's token just sampled alone (the
   model wrote the verified tokens' KV, :mod:`sfi_vllm.patches.drafter_kv`); with ``own`` the same
   rows as the model's step, each extended by the token just sampled, with the rejected drafts as
   padding, writing the drafter's own KV. The token just sampled's query re-selects every
   layer's compact set (a slow step, reason ``verify``): one token per row with
   ``slow_attention: keys`` and a set already made, the row attends through that set while the
   keys are scored (a keys-only slow row, which the kernel path runs inside the pass's CUDA
   graph, refreshed before the next pass); otherwise densely. Or, while fewer than
   ``reuse_budget`` tokens have been verified since the last selection, with ``draft_reselect:
   reuse_budget`` always and with ``rejection`` when the verify kept every draft, a fast step (for
   each of its real tokens with ``own``);
3. ``k - 1`` drafter passes of one token per row: fast steps on that compact set and the recent
   window.

So by default a request's drafts read a selection made at its last verified token; the boundary
trigger, bridge, min_gap, dense_below_context, reuse_stagger and layer_interleaved_refresh of the
lossy mode do not apply (every re-selection refreshes every layer), and the reuse budget only with
``draft_reselect`` reuse_budget or rejection. :func:`plan_draft` turns the
model step's plan and the drafter's attention metadata into each pass's plan.
"""

from __future__ import annotations

from typing import Any

from sfi_vllm.controller import SFIController, StepPlan
from sfi_vllm.trigger import SlowReason, StepMode

PADDING_SLOT = -1  # vLLM's PADDING_SLOT_ID: a rejected draft's position in the drafter's first pass


def plan_draft(controller: SFIController, cam: Any, draft_index: int) -> StepPlan | None:
    """The plan of drafter pass ``draft_index`` (0: the first pass) over ``cam``, whose rows are
    the model step's rows in the same order; None outside a verified step (profiling and warm-up
    runs attend densely). Records the tokens accepted at the first pass, and the drafter's
    slow and fast steps. A pass is planned once per model step: a drafter whose layers fall into
    several attention groups builds each pass's metadata once per group, and those calls get the
    first call's plan (the statistics and the reuse-budget count advance once)."""
    base = controller.current_plan
    if base is None or not base.verify:
        return None
    cached = controller.draft_plans.get(draft_index)
    if cached is not None and cached[0] is base:
        return cached[1]
    plan = _plan_pass(controller, base, cam, draft_index)
    controller.draft_plans[draft_index] = (base, plan)
    return plan


def record_verify_without_drafter(controller: SFIController, req_ids: list[str], sampled: list[list[int]]) -> None:
    """The model's step verified drafts and vLLM then ran no drafter pass (a row's context plus the
    drafts would pass ``max_model_len``: vLLM drafts nothing for the whole batch that step). The
    first pass records the tokens each row kept; here they come from the step's sampled tokens
    (``sampled[j]``: what row ``req_ids[j]`` kept, vLLM's bookkeeping), and the rows' count of
    tokens verified since their selection advances as the first pass would advance it."""
    base = controller.current_plan
    if base is None or not base.verify or base.drafted is None or base.sampled is None:
        return
    index = {r: j for j, r in enumerate(req_ids)}
    for i, rid in enumerate(base.req_ids):
        j = index.get(rid)
        if j is None or j >= len(sampled) or not base.sampled[i] or not sampled[j]:
            continue
        kept = len(sampled[j])  # the accepted drafts and the model's own token
        if base.drafted[i] > 0:
            controller.stats.record_accepted(rid, kept - 1)
        since = controller.verified_since_selection[base.slots[i]]
        if since >= 0:
            controller.verified_since_selection[base.slots[i]] = since + kept


def _keeps_selection(cfg: Any, since: int, verified: int, drafted: int) -> bool:
    """Whether a row's first drafter pass keeps the compact sets of its last selection (a fast
    step) instead of re-selecting: never at a first selection (``since`` -1) or once
    ``reuse_budget`` tokens have been verified since the last one; in between, with
    ``draft_reselect`` reuse_budget always, with rejection only when the verify just made kept
    every draft (``verified``: the drafts kept and the model's own token)."""
    if since < 0 or since + verified >= cfg.reuse_budget:
        return False
    if cfg.draft_reselect == "reuse_budget":
        return True
    return cfg.draft_reselect == "rejection" and verified - 1 >= drafted


def _plan_pass(controller: SFIController, base: StepPlan, cam: Any, draft_index: int) -> StepPlan:
    n = int(cam.num_reqs)
    if n < base.num_reqs:
        raise RuntimeError(f"sfi-vllm: the drafter's batch has {n} rows but the model's step had "
                           f"{base.num_reqs}; the runner hooks are out of step with this vLLM version")
    assert base.sampled is not None and base.drafted is not None
    first = controller.draft_plans.get(0)
    if draft_index > 0 and first is not None and first[0] is base:
        # pass j's rows are the first pass's, j tokens on (vLLM drops the rejected drafts from
        # the lengths and adds one token per pass): no read of the device's lengths
        context = [c + draft_index for c in first[1].context[:base.num_reqs]]
    else:
        context = [int(x) for x in cam.seq_lens[:base.num_reqs].tolist()]
    modes = [int(StepMode.PREFILL)] * base.num_reqs
    reasons = [int(SlowReason.NONE)] * base.num_reqs
    query_tokens = None
    kv_write_tokens = None
    keys_only = [False] * base.num_reqs
    one_token = False
    stats = controller.stats
    if draft_index == 0:
        # drafter_kv shared: one token per row, the token just sampled (sfi_vllm.patches.drafter_kv);
        # otherwise vLLM's layout: each row's verified tokens, the token just sampled, padding
        qsl = cam.query_start_loc_cpu.tolist()
        # one token per row: every row's token sits at or past the row's computed length (a prefill
        # chunk's next token too, which the model's next chunk rewrites before it attends), so the
        # pass writes them all, as the later passes do
        one_token = qsl[n] == n
        if not one_token:
            slot_mapping = cam.slot_mapping[: qsl[n]].tolist()
            query_tokens = list(qsl[:base.num_reqs])
            if controller.cfg.drafter_kv == "shared":
                kv_write_tokens = []  # the model computed every other token of this pass
        for i in range(base.num_reqs):
            if not base.sampled[i]:
                continue  # a prefill chunk that samples nothing: nothing is drafted from it
            if one_token:
                # the model's step held the row's last token and its drafts (base.context); the
                # pass's length counts the kept ones and the token just sampled
                # (at least the token just sampled: at max_model_len the length is clamped)
                verified = max(1, context[i] - (base.context[i] - base.drafted[i] - 1) - 1)
            else:
                start, end = qsl[i], qsl[i + 1]
                pad = 0
                while end - 1 - pad > start and slot_mapping[end - 1 - pad] == PADDING_SLOT:
                    pad += 1
                last = end - 1 - pad  # the token just sampled: the drafts continue from it
                query_tokens[i], context[i] = last, context[i] - pad
                if kv_write_tokens is not None:
                    kv_write_tokens.append(last)
                verified = last - start
            # verified: the accepted drafts and the token just sampled
            if base.drafted[i] > 0:  # the row held drafts
                stats.record_accepted(base.req_ids[i], verified - 1)
            cfg = base.configs[i]
            slot = base.slots[i]
            since = controller.verified_since_selection[slot]
            if cfg.policy in ("dense", "quest"):
                modes[i] = int(StepMode.DENSE)  # no compact set to make (quest selects per step)
            elif _keeps_selection(cfg, since, verified, base.drafted[i]):
                # the compact sets of the last selection still serve: every token of the pass is
                # a fast step on them and the recent window
                modes[i] = int(StepMode.FAST)
                controller.verified_since_selection[slot] = since + verified
            else:
                modes[i], reasons[i] = int(StepMode.SLOW), int(SlowReason.VERIFY)
                # slow_attention keys, one token per row: a row with a set drafts its first token
                # from it while the pass scores the keys for the next set (a first selection, or
                # vLLM's layout of several tokens per row, attends densely)
                keys_only[i] = one_token and since >= 0 and cfg.slow_attention == "keys"
                controller.verified_since_selection[slot] = 0
            stats.record_step(base.req_ids[i], modes[i], reasons[i], context[i])
    else:
        limit = controller.max_model_len
        for i in range(base.num_reqs):
            if not base.sampled[i]:
                continue
            if limit is not None and context[i] > limit:
                # the draft's position is past the longest context: vLLM clamps it, writes no KV
                # and drops the draft; the row runs densely on vLLM's own lengths
                context[i] = int(limit)
                continue
            dense = base.configs[i].policy == "dense"
            modes[i] = int(StepMode.DENSE if dense else StepMode.FAST)
            stats.record_step(base.req_ids[i], modes[i], reasons[i], context[i])
    plan = StepPlan(
        num_reqs=base.num_reqs, req_ids=base.req_ids, slots=base.slots, generations=base.generations,
        modes=modes, reasons=reasons, refresh_all=[True] * base.num_reqs, slow_counts=[0] * base.num_reqs,
        configs=base.configs, context=context, query_tokens=query_tokens, kv_write_tokens=kv_write_tokens,
        keys_only=keys_only if any(keys_only) else None,
    )
    slow = plan.rows(StepMode.SLOW)
    if one_token and slow and controller.executor is not None:
        # the kernel path: the re-selecting rows may run inside the pass's CUDA graph (one token
        # per row, as the later passes), refreshed from the staged queries before the next pass
        controller.executor.plan(plan, slow)
    return plan
