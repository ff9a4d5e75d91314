"""``sfi.refresh_overlap``: the step after a slow step runs beside its per-step refresh.

A row re-selected on step n reads its previous set on step n + 1 and the new one from step n + 2;
the sets themselves are those of an engine that waits for every refresh; a first selection, a
step without a plan and an eager step wait for everything. On the CPU (Triton's interpreter) the
refresh runs inline, so the case checks the bookkeeping (which set a step reads, the copied
query stages, the commits); on CUDA the refresh stream is held up so that the next step really
runs before the refresh, rewriting the layers' query stages while the refresh still has to read
them.
"""

from __future__ import annotations

import pytest
import torch

from builders import assert_same_sets, case, device_batch, shape_id
from sfi_vllm.paged_kv import PagedKV


def overlap_stacks(overlap_values, hq, hkv, d, dtype, device, layers, seq_lens, unified):
    """One controller per ``refresh_overlap`` value, each with ``layers`` GPU-path layers, query
    stages and (``unified``) the executor's one-tensor stages and slot maps, as the CUDA impl
    allocates them when overlapping."""
    from sfi_vllm.backends.cuda_executor import executor_for
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.backends.step_refresh import StepRefresh
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.tools.policies import policy_overrides
    from test_sfi_layer import fake_vllm_config

    n = len(seq_lens)
    ctls, stacks = [], []
    for overlap in overlap_values:
        over = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", 0.15, max(seq_lens)),
                "slow_refresh": "per_step", "slow_in_graph": True, "slow_attention": "keys",
                "fused_scores_tokens": 0, "refresh_overlap": overlap,
                "experimental": {"selector_top_k": "torch"}}
        ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
        ex = executor_for(ctl)
        assert ex.overlap == overlap
        ex.step_refresh = StepRefresh(capture_after=2)
        ex.graph_slow_ready = True
        cap = ctl.cfg.compact_capacity(8192)
        if unified and overlap:
            ex.stages = torch.full((layers, n + 2, hq, d), float("nan"), dtype=dtype, device=device)
            ex.live_maps = torch.zeros(layers, 8, dtype=torch.int32, device=device)
        stack = []
        for i in range(layers):
            live = ex.live_maps[i] if ex.live_maps is not None else None
            layer = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=PackedCompactBuffer(
                8, hkv, cap, d, dtype, device, double_buffer=True, slot_map_dev=live))
            layer.stage = (ex.stages[i] if ex.stages is not None
                           else torch.full((n + 2, hq, d), float("nan"), dtype=dtype, device=device))
            stack.append(layer)
        ctls.append(ctl)
        stacks.append(stack)
    return ctls, stacks


def check_refresh_overlap(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                          seq_lens=(3000, 900, 5000, 1400), layers=3, unified=False,
                          sleep_cycles=200_000_000):
    from sfi_vllm.backends.common import uniform_table_rows, uniform_tables
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import plan_for
    from sfi_vllm.kernels.fast_decode import uniform_workspace_numel

    n = len(seq_lens)
    (ctl, ref_ctl), (stack, ref_stack) = overlap_stacks((True, False), hq, hkv, d, dtype, device, layers, seq_lens, unified)
    paged0, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=5)
    g = torch.Generator().manual_seed(17)
    # each layer its own cache, the same data in both engines
    noise = [0.7 * torch.randn(paged0.kv_cache.shape, generator=g).to(device, dtype) for _ in range(layers)]
    caches = {id(c): [PagedKV(paged0.kv_cache + noise[li], "flash", d) for li in range(layers)] for c in (ctl, ref_ctl)}
    for (c, st) in ((ctl, stack), (ref_ctl, ref_stack)):
        for layer, p in zip(st, caches[id(c)]):
            layer.kv = p.nhd_views()
    # the engine default, balanced splits: the larger grids' workspace
    assert ctl.cfg.balanced_splits and ref_ctl.cfg.balanced_splits
    ws = torch.empty(uniform_workspace_numel(n, hq, hkv, d, balanced=True), dtype=torch.float32, device=device)
    ctx = list(seq_lens)
    reselected = [0, 2]  # the rows of the keys-only slow step

    def plan(c, modes, keys_only=None):
        p = plan_for(modes, cfg=c.cfg, context=ctx)
        p.keys_only = keys_only
        if any(m == StepMode.SLOW for m in modes):
            p.graph_slow = True
        return p

    def uniform_step(c, st, p, qs, step_no, join=True):
        """One uniform step as the engine runs it: the builder's join, the layers' launches, the
        runner's end of step. Returns the layers' outputs."""
        if join:
            c.executor.join_refresh(p, step_no)
        tables = uniform_tables(p, cam, persistent[id(c)], c, hkv)
        outs = []
        for li, layer in enumerate(st):
            out = torch.full_like(qs[li], float("nan"))
            layer.fast_uniform(tables, caches[id(c)][li], qs[li], out, ws)
            outs.append(out.float().cpu())
        if p.graph_slow:
            c.executor.note_graph_slow(p, cam.block_table_tensor)
        c.planned_steps = step_no
        c.end_step()
        return outs

    persistent = {id(c): torch.zeros(uniform_table_rows(False, True), n, dtype=torch.int32, device=device)
                  for c in (ctl, ref_ctl)}
    q_first = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
    q_keys = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
    q_read = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
    fast = [StepMode.FAST] * n
    keys_modes = [StepMode.SLOW if r in reselected else StepMode.FAST for r in range(n)]
    keys_only = [r in reselected for r in range(n)]

    # the reference engine: first selection, a fast step on those sets, the keys-only slow step,
    # a fast step on the new sets
    uniform_step(ref_ctl, ref_stack, plan(ref_ctl, [StepMode.SLOW] * n), q_first, 1)
    ref_old = uniform_step(ref_ctl, ref_stack, plan(ref_ctl, fast), q_read, 2)
    uniform_step(ref_ctl, ref_stack, plan(ref_ctl, keys_modes, keys_only), q_keys, 3)
    ref_new = uniform_step(ref_ctl, ref_stack, plan(ref_ctl, fast), q_read, 4)
    ref_ctl.executor.join_refresh()

    ex = ctl.executor
    # step 1: every row's first selection; step 2 must wait for it (no row has a set before it)
    uniform_step(ctl, stack, plan(ctl, [StepMode.SLOW] * n), q_first, 1)
    assert len(ex.commits) == 1 and ex.commits[0].first
    old = uniform_step(ctl, stack, plan(ctl, fast), q_read, 2)
    assert not ex.commits, "a first selection must be published before the next step"
    for a, b in zip(old, ref_old):
        assert torch.equal(a, b), "after the first selection"
    # step 3: the keys-only slow step, its refresh held up on the refresh stream
    side = ex.refresh_stream(torch.device(device))
    if side is not None:
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
    uniform_step(ctl, stack, plan(ctl, keys_modes, keys_only), q_keys, 3)
    assert len(ex.commits) == 1 and not ex.commits[0].first and ex.commits[0].step == 3
    # step 4 runs beside it (it rewrites every layer's query stage) and reads the previous sets
    during = uniform_step(ctl, stack, plan(ctl, fast), q_read, 4)
    assert len(ex.commits) == 1, "the previous step's refresh is published a step later"
    for a, b in zip(during, ref_old):
        assert torch.equal(a, b), "the step beside the refresh must read the previous sets"
    # step 5 reads the new sets, which are the waiting engine's
    after = uniform_step(ctl, stack, plan(ctl, fast), q_read, 5)
    assert not ex.commits
    for a, b in zip(after, ref_new):
        assert torch.isfinite(a).all() and torch.equal(a, b), "from the second step on: the new sets"
    assert any(not torch.equal(a, b) for a, b in zip(after, during)), "inconclusive: the sets did not change"
    ex.join_refresh()
    assert_same_sets(ref_stack, stack, n)
    return 0.0


CPU_SHAPE = dict(hq=6, hkv=3, d=32)


@pytest.mark.parametrize("device,dtype,kw", [
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=(160, 96, 224), layers=1, unified=True),
         id="unified-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cuda", torch.bfloat16, dict(unified=True), id="unified-" + shape_id(torch.bfloat16, 32, 8, 128)),
    case("cuda", torch.bfloat16, dict(), id="per-layer-stages-" + shape_id(torch.bfloat16, 32, 8, 128)),
])
def test_refresh_overlap(device, dtype, kw):
    check_refresh_overlap(device, dtype, **kw)


def test_steps_that_cannot_run_beside_a_refresh_wait_for_all_of_it():
    """The join's rules on the host: without a plan, for an eager step, after a per-layer refresh
    and for a pending first selection everything is published; otherwise the previous step's
    flush stays pending and older ones are published, in order."""
    from sfi_vllm.backends.cuda_executor import CudaExecutor
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import plan_for

    cfg = build_config({"boundary_token_ids": [7], "refresh_overlap": True}, use_env=False)
    ex = CudaExecutor(cfg)
    assert ex.overlap
    assert not CudaExecutor(build_config({}, use_env=False)).overlap  # off by default
    assert not CudaExecutor(build_config({"refresh_overlap": True, "kernels": "torch"}, use_env=False)).overlap
    buf = PackedCompactBuffer(4, 1, 8, 4, torch.float32, "cpu", double_buffer=True)

    def commit(step, slot, target, first=False):
        ex.defer_commit(step=step, layers=[buf], slots=torch.tensor([slot]),
                        targets=torch.tensor([[target]], dtype=torch.int32), first=first)

    fast = plan_for([StepMode.FAST] * 2, cfg=cfg, context=[100, 100])
    commit(3, 0, 1)
    commit(4, 1, 3)
    ex.join_refresh(fast, 5)  # step 3's flush is published; step 4's runs beside step 5
    assert buf.slot_map_dev.tolist() == [1, 2, 4, 6] and [c.step for c in ex.commits] == [4]
    ex.join_refresh(fast, 5)  # a second build of the same step changes nothing
    assert buf.slot_map_dev.tolist() == [1, 2, 4, 6]
    for blocker in ("no plan", "prefill", "eager", "per-layer", "first"):
        commit(5, 2, 5, first=blocker == "first")
        p = fast
        if blocker == "no plan":  # also what the builder passes for a step it does not make uniform
            p = None
        elif blocker == "prefill":
            p = plan_for([StepMode.PREFILL, StepMode.FAST], cfg=cfg, context=[100, 100])
            assert not p.needs_eager
        elif blocker == "eager":
            p = plan_for([StepMode.SLOW, StepMode.FAST], cfg=cfg, context=[100, 100])  # not in a graph
            assert p.needs_eager
        elif blocker == "per-layer":
            ex.fork_refresh(torch.device("cpu"))
        ex.join_refresh(p, 6)
        assert not ex.commits and not ex.direct_pending, blocker
        assert buf.slot_map_dev.tolist() == [1, 3, 5, 6], blocker
        buf.slot_map_dev[:] = torch.tensor([1, 3, 4, 6], dtype=torch.int32)
    # a step whose slow rows' scores the fast-step kernel writes (frames the refresh may read)
    from sfi_vllm.backends.step_refresh import ScoreFrame

    commit(5, 2, 5)
    p = plan_for([StepMode.SLOW, StepMode.FAST], cfg=cfg, context=[100, 100])
    p.graph_slow, p.score_layout = True, {("k",): ScoreFrame(0, 2048, True)}
    ex.join_refresh(p, 6)
    assert not ex.commits and buf.slot_map_dev.tolist() == [1, 3, 5, 6]
    commit(5, 2, 4)
    p.score_layout = {("k",): ScoreFrame(0, 2048, False)}  # scored by the refresh: may run beside
    ex.join_refresh(p, 6)
    assert [c.step for c in ex.commits] == [5]


def test_refresh_overlap_settings():
    from sfi_vllm.config import build_config

    assert not build_config({}, use_env=False).overlap_enabled
    assert build_config({"refresh_overlap": True}, use_env=False).overlap_enabled
    for bad in ({"refresh_overlap": True, "side_stream": False}, {"refresh_overlap": True, "mode": "lossless"}):
        with pytest.raises(ValueError, match="refresh_overlap needs side_stream on and mode lossy"):
            build_config(bad, use_env=False)
