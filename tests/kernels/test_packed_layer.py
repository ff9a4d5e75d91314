"""The GPU layer path (score kernel, batched Selector, repack, fast-step tables, uniform launch)
against the reference layer, per layer (``check_packed_layer``), per step (``check_step_refresh``:
``slow_refresh = "per_step"``) and as a uniform step (``check_graph_slow``: ``slow_in_graph``).

The ``selection``-marked cases are those a change to the Selector or its settings needs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, assert_same_sets, case, device_batch, refresh_stacks, shape_id
from sfi_vllm.paged_kv import PagedKV


def with_top_k(over: dict, top_k: str) -> dict:
    """``over`` with ``experimental.selector_top_k``. The CPU cases take torch's top-K (the
    reference): the page kernel's interpreter run costs seconds per Selector call, and it has
    its own interpreter cases (test_top_k_pages.py) and one through the layer here
    (``fused-triton_top_k``); the GPU cases run the engine's default."""
    return {**over, "experimental": {**over.get("experimental", {}), "selector_top_k": top_k}}


def check_packed_layer(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                       seq_lens=(3000, 900, 5000, 1400), retention=0.15, policy="sfi", refresh="per_layer",
                       top_k="auto"):
    """The GPU layer path (score kernel + batched Selector + one repack; fast rows through the
    step's tables; the uniform all-rows launch with a dense row and a padding row) against the
    reference layer (per-row torch selector, gathered keys, reference attention)."""
    from sfi_vllm.backends.common import FastRows, SFILayer, attach_fast_tables, fast_row_tables, make_step
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from sfi_vllm.kernels.fast_decode import uniform_workspace_numel
    from test_sfi_layer import fake_vllm_config, plan_for

    n = len(seq_lens)
    over = with_top_k({"boundary_token_ids": [7], "min_gap": 0, "slow_refresh": refresh,
                       **policy_overrides(policy, retention, max(seq_lens))}, top_k)
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    cfg = ctl.cfg
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)  # first: its buffer feeds the stats
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    # a second GPU-path layer over the same step: it reuses what the first left in the step's
    # layer cache (index tensors, positions buffer, repack metadata) and must match as well
    packed2 = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast2 = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed2)
    paged, cam, qd = device_batch(seq_lens, device, dtype, hq, hkv, d)
    ctx = list(seq_lens)
    slow = make_step(plan_for([StepMode.SLOW] * n, cfg=cfg, context=ctx), cam, lambda s: None)
    # the fast step: one token later for every row (the window slides by one)
    modes = [StepMode.FAST] * (n - 1) + [StepMode.DENSE]
    step = make_step(plan_for(modes, cfg=cfg, context=ctx), cam, lambda s: None)
    attach_fast_tables(step, cam, ctl)
    outs = []
    for layer in (ref, fast, fast2):
        layer.refresh(slow, paged, qd, 0)
        ctl.end_step()  # the runner hook after the forward (runs a per-step refresh)
        ctl.executor.join_refresh()  # what the metadata builder does at the start of the next step
        out = torch.full_like(qd, float("nan"))
        layer.fast(step, paged, qd, out)
        outs.append(out[: n - 1].float().cpu())
    same = 0
    for row in range(n):
        entry = ref.buffer.get(row, 1)
        k = entry.num_tokens
        assert packed.length[row] == k and packed.window_start[row] == entry.window_start
        phys = packed.slot_map[row]
        assert int(packed.slot_map_dev[row]) == phys
        assert int(packed.length_dev[phys]) == k and int(packed.window_start_dev[phys]) == entry.window_start
        ref_keys = entry.keys.to(dtype).cpu()
        got = packed.published_keys(row).cpu()
        same += (got == ref_keys).all(-1).float().mean().item()
    assert same / n > 0.97, f"selections differ: {same / n:.3f} of tokens identical"
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 2e-2, f"fast rows: {err}"
    assert torch.equal(outs[2], outs[1]), "a second layer of the same step (cached step tensors) differs"
    assert slow.layer_cache, "the step's layer cache was not used"
    # the uniform launch: the same fast rows, the last row dense, one padding row (seq_len 0)
    tables = torch.zeros(2, n + 1, dtype=torch.int32)
    tables[:, :n] = fast_row_tables(step.plan, list(range(n)))
    tables[0, n] = -1
    uni = FastRows(rows=n + 1, slot=tables[0].to(device), min_window_start=tables[1].to(device),
                   seq_lens=torch.tensor(ctx + [0], dtype=torch.int32, device=device),
                   block_table=torch.cat([cam.block_table_tensor, cam.block_table_tensor[:1]]))
    qu = torch.cat([qd, qd[:1]])
    out = torch.full_like(qu, float("nan"))
    ws = torch.empty(uniform_workspace_numel(8, hq, hkv, d, balanced=True), dtype=torch.float32, device=device)
    fast.fast_uniform(uni, paged, qu, out, ws)
    out = out.float().cpu()
    err = ((out[: n - 1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 2e-2, f"uniform fast rows: {err}"
    from sfi_vllm.attention_ref import dense_attention

    keys, values = paged.gather_range(cam.block_table_tensor[n - 1], 0, ctx[-1])
    dense = dense_attention(qd[n - 1], keys, values, d ** -0.5).cpu()
    assert ((out[n - 1] - dense).norm() / dense.norm()).item() < 2e-2, "dense row"
    assert torch.all(out[n] == 0), "padding row"
    # sfi.experimental.wide_dense_tiles: the same launch with the dense row over the threshold
    import sfi_vllm.kernels.fast_decode as fd

    launches = []
    plain = fd.fast_decode_attention

    def spy(*args, **kwargs):
        launches.append((kwargs.get("wide_block_n"), kwargs.get("wide_from")))
        return plain(*args, **kwargs)

    fast.wide_dense_from = ctx[-1] - 1
    wide_out = torch.full_like(qu, float("nan"))
    fd.fast_decode_attention = spy
    try:
        fast.fast_uniform(uni, paged, qu, wide_out, ws)
    finally:
        fd.fast_decode_attention = plain
    assert launches == [(64, ctx[-1] - 1)], launches
    wide_out = wide_out.float().cpu()
    assert ((wide_out[: n - 1] - out[: n - 1]).norm() / out[: n - 1].norm()).item() < 1e-3, "wide: fast rows"
    assert ((wide_out[n - 1] - dense).norm() / dense.norm()).item() < 2e-2, "wide: dense row"
    assert torch.all(wide_out[n] == 0), "wide: padding row"
    # sfi.balanced_splits: each row its share of a larger grid, the dense row most of it
    from sfi_vllm.backends.common import row_keys

    fast.wide_dense_from = 0
    work = row_keys(step.plan) + [0]
    assert work[n - 1] == ctx[-1] and max(work[: n - 1]) < ctx[-1], work
    per_row = fd.balanced_row_splits(work, hkv)
    assert per_row[n - 1] == max(per_row) and per_row[n] == 1, per_row
    bal = FastRows(rows=n + 1, slot=uni.slot, min_window_start=uni.min_window_start, seq_lens=uni.seq_lens,
                   block_table=uni.block_table, splits=torch.tensor(per_row, dtype=torch.int32, device=device))
    ws.fill_(float("nan"))  # an idle program's partial output must not reach the merge
    bal_out = torch.full_like(qu, float("nan"))
    fast.fast_uniform(bal, paged, qu, bal_out, ws)
    bal_out = bal_out.float().cpu()
    assert ((bal_out[: n] - out[: n]).norm() / out[: n].norm()).item() < 1e-3, "balanced: rows"
    assert torch.all(bal_out[n] == 0), "balanced: padding row"
    return err


def check_step_refresh(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                       seq_lens=(3000, 900, 5000, 1400), layers=3, steps=4, retention=0.15, chunk_bytes=None,
                       top_k="auto", slow_sets=None, graphs=None, max_graphs=None, runs=None):
    """``slow_refresh = "per_step"`` (queries staged per layer, every layer selected and repacked
    when the step ends, replayed from a CUDA graph) against ``"per_layer"``, layer by layer: each
    layer has its own cache and queries, so a mixed-up layer shows. Several slow steps with new
    data: on CUDA the first runs eagerly, the second captures, the later ones replay (and must
    read their own inputs). ``chunk_bytes`` small: one layer per Selector launch. ``slow_sets``:
    the rows that are slow at each step, in turn (the others decode densely); each set is a shape
    of its own (``graphs``: how many shapes they make, if padding merges some), whose graphs share
    one memory pool, so a graph replayed after another's capture must still compute its own
    selection. ``max_graphs``: the refresh's limit (a smaller one evicts); ``runs``: the eager,
    captured and replayed counts expected on CUDA (default: each shape eager, captured, then
    replayed)."""
    from sfi_vllm.backends.common import make_step
    from sfi_vllm.backends.step_refresh import StepRefresh
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import plan_for

    n = len(seq_lens)
    base = with_top_k({"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", retention, max(seq_lens))},
                      top_k)
    ctls, stacks = refresh_stacks([{**base, "slow_refresh": m} for m in ("per_layer", "per_step")],
                                  hq, hkv, d, dtype, device, layers)
    ctls[1].executor.step_refresh = StepRefresh(capture_after=2, **({} if chunk_bytes is None else {"logits_bytes": chunk_bytes}),
                                                **({} if max_graphs is None else {"max_graphs": max_graphs}))
    g = torch.Generator().manual_seed(11)
    paged0, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=7)
    # each layer's cache, allocated once (an engine's caches persist; a graph holds their addresses)
    pageds = [PagedKV(paged0.kv_cache.clone(), "flash", d) for _ in range(layers)]
    slow_sets = slow_sets or [range(n)]
    for it in range(steps):
        for p in pageds:  # new data in place
            p.kv_cache.copy_(paged0.kv_cache + 0.7 * torch.randn(paged0.kv_cache.shape, generator=g).to(device, dtype))
        qs = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
        slow = set(slow_sets[it % len(slow_sets)])
        modes = [StepMode.SLOW if r in slow else StepMode.DENSE for r in range(n)]
        for ctl, stack in zip(ctls, stacks):
            step = make_step(plan_for(modes, cfg=ctl.cfg, context=list(seq_lens)), cam, lambda s: None)
            for li, layer in enumerate(stack):
                layer.refresh(step, pageds[li], qs[li], li)
            ctl.end_step()  # the per-step refresh runs here
            ctl.executor.join_refresh()
        assert not ctls[1].executor.step_refresh.pending
        assert_same_sets(stacks[0], stacks[1], n, values=True)
    sr = ctls[1].executor.step_refresh
    shapes = graphs or len(slow_sets)
    # one entry per shape (on the CPU too: padding that merged no shapes shows here)
    assert len(sr._entries) == min(shapes, max_graphs or shapes), list(sr._entries)
    if device == "cuda":
        if runs is None:  # each shape: eager, captured, then replayed
            assert steps % shapes == 0 and steps >= 3 * shapes
            runs = (shapes, shapes, steps - 2 * shapes)
        assert (sr.eager_runs, sr.captures, sr.replays) == runs, (sr.eager_runs, sr.captures, sr.replays)
        assert sr._scratch is None or sr._scratch.numel() >= sr.logits_bytes // 4, "the scratch at its size at once"
    return 0.0


def check_graph_slow(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                     seq_lens=(3000, 900, 5000, 1400), layers=3, steps=4, retention=0.15, fused=False,
                     top_k="torch", keys=False, keys_in_kernel=False, chunk_bytes=None, balanced=True):
    """``slow_in_graph``: a slow step run as a uniform step (the fast-step kernel attends densely
    for the slow rows and stages every row's query; the refresh runs from the plan when the step
    ends) against the per-layer refresh of the same queries, layer by layer, and the slow rows'
    outputs against dense attention. On CUDA the later steps replay the refresh graph. ``fused``
    (``fused_scores_tokens``): the kernel also writes the slow rows' logits and key norms, and
    the refresh reads them instead of running the score kernel (``slow_attention: dense``; with
    ``keys`` the refresh scores into them). ``top_k``: ``experimental.selector_top_k`` of
    the graph step's engine (the reference's is torch's). ``keys`` (``slow_attention: keys``): from
    the second step on the slow rows attend through the sets they have (against the reference
    layers' eager fast path over the same sets) and are scored in the refresh into the fused frames
    (``keys_in_kernel``: by the fast-step kernel's keys-only pass). ``chunk_bytes``: the refresh's
    logits budget (1: one layer per Selector call). ``balanced``: ``balanced_splits`` (the
    engine's default; false: every row the same split count)."""
    from sfi_vllm.attention_ref import dense_attention
    from sfi_vllm.backends.common import attach_fast_tables, make_step, uniform_table_rows, uniform_tables
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.backends.step_refresh import FusedScoreBuffers, StepRefresh
    from sfi_vllm.compact import RowGeometry
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from sfi_vllm.kernels.fast_decode import uniform_workspace_numel
    from test_sfi_layer import plan_for

    n = len(seq_lens)
    base = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", retention, max(seq_lens)),
            "slow_attention": "keys" if keys else "dense"}
    # fused: room for the step's frames (one group: every row gets the largest context rounded up
    # to the frame bucket) and no more
    tokens = n * SlowStepSelection.frame_width(max(seq_lens)) if fused else 0
    (ref_ctl, ctl), stacks = refresh_stacks([with_top_k({**base, "slow_refresh": "per_layer"}, "torch"),
                                             {**base, "slow_refresh": "per_step", "slow_in_graph": True,
                                              "fused_scores_tokens": tokens,
                                              "balanced_splits": balanced,
                                              "experimental": {"selector_top_k": top_k, "keys_only_scores":
                                                               "fast_kernel" if keys_in_kernel else "refresh"}}],
                                            hq, hkv, d, dtype, device, layers)
    ctl.executor.step_refresh = StepRefresh(capture_after=2, **({} if chunk_bytes is None else
                                                                 {"logits_bytes": chunk_bytes}))
    ctl.executor.graph_slow_ready = True  # as the CUDA impl sets it when its layers get query stages
    if fused:  # as the CUDA impl allocates them
        ctl.executor.fused_scores = FusedScoreBuffers.allocate(tokens, layers, hq, hkv, device)
    assert ctl.executor._slow_rows_fit_graph([ctl.cfg] * n, [RowGeometry.at(ctl.cfg, c) for c in seq_lens])
    g = torch.Generator().manual_seed(13)
    paged0, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=9)
    pageds = [PagedKV(paged0.kv_cache.clone(), "flash", d) for _ in range(layers)]
    for layer, p in zip(stacks[1], pageds):
        layer.stage = torch.full((n + 2, hq, d), float("nan"), dtype=dtype, device=device)
        layer.kv = p.nhd_views()
    persistent = torch.zeros(uniform_table_rows(fused, balanced), n, dtype=torch.int32, device=device)
    ws = torch.empty(uniform_workspace_numel(n, hq, hkv, d, balanced=balanced), dtype=torch.float32, device=device)
    if balanced:
        ws.fill_(float("nan"))  # an idle program's partial output must not reach the merge
    for it in range(steps):
        on_set = keys and it > 0  # keys-only slow rows, once they have sets
        for p in pageds:
            p.kv_cache.copy_(paged0.kv_cache + 0.7 * torch.randn(paged0.kv_cache.shape, generator=g).to(device, dtype))
        qs = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
        # reference: the per-layer refresh of an eager slow step (keys-only: its fast path first)
        ref_plan = plan_for([StepMode.SLOW] * n, cfg=ref_ctl.cfg, context=list(seq_lens))
        ref_plan.keys_only = [True] * n if on_set else None
        step = make_step(ref_plan, cam, lambda s: None)
        ref_outs = []
        if on_set:
            attach_fast_tables(step, cam, ref_ctl)
        for li, layer in enumerate(stacks[0]):
            if on_set:
                out = torch.full_like(qs[li], float("nan"))
                layer.fast(step, pageds[li], qs[li], out)
                ref_outs.append(out.float().cpu())
            layer.refresh(step, pageds[li], qs[li], li)
        ref_ctl.end_step()
        ref_ctl.executor.join_refresh()
        # the same slow step as a uniform step
        plan = plan_for([StepMode.SLOW] * n, cfg=ctl.cfg, context=list(seq_lens))
        plan.keys_only = [True] * n if on_set else None
        plan.graph_slow = True
        assert not plan.needs_eager
        if fused:
            plan.score_layout = ctl.executor._score_layout(plan)
            assert plan.score_layout is not None and ctl.executor.fused_score_misses == 0
            ctl.executor.fused_scores.logits.fill_(float("nan"))  # what the refresh reads must be this step's
            ctl.executor.fused_scores.norms.fill_(float("nan"))
        tables = uniform_tables(plan, cam, persistent, ctl, hkv)
        assert (tables.splits is not None) == balanced
        for li, layer in enumerate(stacks[1]):
            out = torch.full_like(qs[li], float("nan"))
            layer.fast_uniform(tables, pageds[li], qs[li], out, ws)
            assert torch.equal(layer.stage[:n], qs[li]), "query staging"
            for r in (0, n - 1):  # slow rows attend densely, or keys-only ones through their sets
                if on_set:
                    want = ref_outs[li][r]
                else:
                    kk, vv = pageds[li].gather_range(cam.block_table_tensor[r], 0, seq_lens[r])
                    want = dense_attention(qs[li][r], kk, vv, d ** -0.5).float().cpu()
                assert ((out[r].float().cpu() - want).norm() / want.norm()).item() < 2e-2, ("slow row", on_set)
        ctl.executor.note_graph_slow(plan, cam.block_table_tensor)
        ctl.end_step()
        ctl.executor.join_refresh()
        assert not ctl.executor.step_refresh.pending
        assert_same_sets(stacks[0], stacks[1], n)
    sr = ctl.executor.step_refresh
    # one source for every step (slow_attention keys: the dense first step's rows too are scored
    # after the step), so one graph
    sources = {key[2] for key in sr._entries}
    after = fused and keys and not keys_in_kernel
    assert not ctl.executor.overlap  # the refresh reads the layers' stages (tests/kernels/test_refresh_overlap.py: copies)
    assert sources == ({("fused-refresh", 0)} if after else {("fused", 0)} if fused else {"graph"}), sources
    if device == "cuda":
        assert (sr.eager_runs, sr.captures, sr.replays) == (1, 1, steps - 2), (sr.eager_runs, sr.captures, sr.replays)
    return 0.0


CPU_SHAPE = dict(hq=6, hkv=3, d=32)
CPU_ROWS = (300, 150, 420, 200)
GPU = [(dtype, dict(hq=hq, hkv=hkv, d=d)) for dtype in GPU_DTYPES for hq, hkv, d in GPU_SHAPES]


@pytest.mark.parametrize("device,dtype,kw", [
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=(600, 300, 900, 400), top_k="torch"),
         id="sfi-per_layer-" + shape_id(torch.float32, **CPU_SHAPE)),
    *(case("cuda", dtype, dict(**shape, policy=policy), id=f"{policy}-per_layer-" + shape_id(dtype, **shape),
           selection=policy == "sfi" and dtype == torch.bfloat16)
      for dtype, shape in GPU for policy in ("sfi", "streaming", "snapkv")),
    *(case("cuda", dtype, dict(**shape, refresh="per_step"), id="sfi-per_step-" + shape_id(dtype, **shape),
           selection=dtype == torch.bfloat16)
      for dtype, shape in GPU),
])
def test_packed_layer(device, dtype, kw):
    check_packed_layer(device, dtype, **kw)


@pytest.mark.parametrize("device,dtype,kw", [
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=2, top_k="torch"),
         id="layers2-steps2-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=2, top_k="torch",
                                    slow_sets=[(0, 1, 2, 3), (1, 3)]),
         id="layers2-steps2-two_shapes-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=3, top_k="torch",
                                    slow_sets=[(0, 1, 2, 3), (0, 2, 3), (1,)], graphs=2),
         id="layers2-steps3-padded-" + shape_id(torch.float32, **CPU_SHAPE)),
    # rows and frame padded: three rows with a 1,536-token frame take the shape of four with 2,048
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=(1800, 700, 1100, 650), layers=2, steps=2,
                                    top_k="torch", slow_sets=[(0, 1, 2, 3), (1, 2, 3)], graphs=1),
         id="layers2-steps2-padded_frame-" + shape_id(torch.float32, **CPU_SHAPE)),
    *(case("cuda", dtype, shape, id="layers3-steps4-" + shape_id(dtype, **shape), selection=dtype == torch.bfloat16)
      for dtype, shape in GPU),
    *(case("cuda", dtype, dict(**shape, chunk_bytes=1), id="layers3-steps4-chunk1-" + shape_id(dtype, **shape))
      for dtype, shape in GPU),
    *(case("cuda", dtype, dict(**shape, steps=6, slow_sets=[(0, 1, 2, 3), (1, 3)]),
           id="layers3-steps6-two_shapes-" + shape_id(dtype, **shape))
      for dtype, shape in GPU),
    # three rows padded to four (an 8K frame: small enough to pad): the four rows' graph
    *(case("cuda", dtype, dict(**shape, steps=4, slow_sets=[(0, 1, 2, 3), (0, 2, 3)], graphs=1),
           id="layers3-steps4-padded-" + shape_id(dtype, **shape))
      for dtype, shape in GPU),
    # one graph kept: the second shape evicts the first's graph (the pool's last), then captures
    # into a new pool
    *(case("cuda", dtype, dict(**shape, steps=6, slow_sets=[(0, 1, 2, 3)] * 3 + [(1, 3)] * 3, graphs=2,
                               max_graphs=1, runs=(2, 2, 2)),
           id="layers3-steps6-evicted-" + shape_id(dtype, **shape))
      for dtype, shape in GPU),
])
def test_step_refresh(device, dtype, kw):
    check_step_refresh(device, dtype, **kw)


@pytest.mark.parametrize("device,dtype,kw", [
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=1),
         id="unfused-torch_top_k-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=1, fused=True, top_k="triton",
                                    chunk_bytes=1),
         id="fused-triton_top_k-chunk1-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=2, fused=True, keys=True,
                                    chunk_bytes=1),
         id="fused-keys-chunk1-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=2, fused=True, keys=True,
                                    keys_in_kernel=True),
         id="fused-keys_in_kernel-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, layers=2, steps=2, fused=True, keys=True,
                                    keys_in_kernel=True, balanced=False),
         id="fused-keys_in_kernel-equal_splits-" + shape_id(torch.float32, **CPU_SHAPE)),
    *(case("cuda", dtype, dict(**shape, **over), id=name + shape_id(dtype, **shape),
           selection=dtype == torch.bfloat16 and "top_k" not in over)
      for dtype, shape in GPU
      for name, over in (("unfused-torch_top_k-", {}), ("fused-torch_top_k-", dict(fused=True)),
                         ("unfused-triton_top_k-", dict(top_k="triton")), ("fused-keys-", dict(fused=True, keys=True)),
                         ("fused-keys_in_kernel-", dict(fused=True, keys=True, keys_in_kernel=True)),
                         ("fused-keys_in_kernel-equal_splits-", dict(fused=True, keys=True, keys_in_kernel=True,
                                                                     balanced=False)),
                         ("unfused-keys-", dict(keys=True)))),
])
def test_graph_slow(device, dtype, kw):
    check_graph_slow(device, dtype, **kw)


def check_drafter_pass(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                       seq_lens=(3000, 900, 5000, 1400), query_lens=(3, 1, 5, 2), padding=(1, 0, 2, 0),
                       retention=0.15, refresh="per_layer", sliding=False, top_k="auto"):
    """A drafter's first pass (``sfi.mode lossless``) on the GPU layer path against the reference
    layer. Each row holds several verified tokens, then ``padding`` tokens of rejected drafts. By
    default the pass re-selects every row from its last real token: the rows attend densely
    (FlashAttention's part, not run here), so only the sets are compared. With
    ``draft_reselect: reuse_budget`` the pass is a fast step instead: every real token attends to
    the set and to the window up to itself, and a padding token's output is zero. The per-step
    refresh is staged by the layer and run by the next pass's metadata build
    (``SFIBuilderMixin.build_for_drafting``)."""
    from dataclasses import dataclass

    from sfi_vllm.backends.common import SFIBuilderMixin, SFILayer, SFIStep, attach_fast_tables, make_step
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import fake_vllm_config, plan_for

    n = len(seq_lens)
    over = with_top_k({"boundary_token_ids": [7], "min_gap": 0, "slow_refresh": refresh,
                       **policy_overrides("sfi", retention, max(seq_lens))}, top_k)
    if sliding:
        over["window_mode"] = "slide"
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    cfg = ctl.cfg
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    paged, cam, qd = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=3, query_lens=query_lens)
    qsl = cam.query_start_loc_cpu.tolist()
    last = [qsl[i + 1] - 1 - padding[i] for i in range(n)]  # each row's last real token
    ctx = [s - p for s, p in zip(seq_lens, padding)]  # the rejected drafts are not in the context

    def plan(mode, context):
        p = plan_for([mode] * n, cfg=cfg, context=context)
        p.query_tokens = last
        return p

    @dataclass
    class Meta:  # the platform metadata's fields, none needed here
        sfi: SFIStep | None = None
        sfi_uniform: object = None

    class Platform:
        def build(self, common_prefix_len, cam, fast_build=False):
            return Meta()

    class Builder(SFIBuilderMixin, Platform):
        metadata_cls = Meta

    builder = object.__new__(Builder)
    builder.controller = ctl
    # the sets are selected 40 tokens before the fast pass, so that a sliding window has moved
    # on by each of its tokens
    slow = make_step(plan(StepMode.SLOW, [c - 40 for c in ctx]), cam, lambda s: None)
    assert slow.kernel_rows == list(range(n)) and not slow.fast_rows
    for layer in (ref, fast):
        layer.refresh(slow, paged, qd, 0)
    builder.build_for_drafting(cam, 1)  # the next pass: runs the staged per-step refresh
    assert not ctl.executor.step_refresh.pending
    ctl.executor.join_refresh()
    for row in range(n):
        entry = ref.buffer.get(row, 1)
        assert packed.length[row] == entry.num_tokens and packed.window_start[row] == entry.window_start
        same = (packed.published_keys(row).cpu() == entry.keys.to(dtype).cpu()).all(-1).float().mean().item()
        assert same > 0.97, f"row {row}: {same:.3f} of the compact set identical"
    # reuse_budget: the next first pass is a fast step for every real token
    step = make_step(plan(StepMode.FAST, ctx), cam, lambda s: None)
    attach_fast_tables(step, cam, ctl)
    assert step.fast_tables.rows == sum(q - p for q, p in zip(query_lens, padding))
    outs = []
    for layer in (ref, fast):
        out = torch.full_like(qd, float("nan"))
        layer.fast(step, paged, qd, out)
        outs.append(out.float().cpu())
    real = [u for i in range(n) for u in range(qsl[i], last[i] + 1)]
    pad = [u for i in range(n) for u in range(last[i] + 1, qsl[i + 1])]
    assert not outs[1][real].isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # a window start off by a token shows in float32
    for u in real:
        err = ((outs[1][u] - outs[0][u]).norm() / outs[0][u].norm()).item()
        assert err < tol, f"fast token {u}: {err}"
    assert torch.all(outs[1][pad] == 0) and torch.all(outs[0][pad] == 0), "padding tokens"
    return err


@pytest.mark.parametrize("device,dtype,kw", [
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=(600, 300, 900, 400), top_k="torch"),
         id="per_layer-" + shape_id(torch.float32, **CPU_SHAPE)),
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=(600, 300, 900, 400), refresh="per_step", sliding=True,
                                    top_k="torch"),
         id="per_step-sliding-" + shape_id(torch.float32, **CPU_SHAPE)),
    *(case("cuda", dtype, dict(**shape, refresh=refresh), id=f"{refresh}-" + shape_id(dtype, **shape))
      for dtype, shape in GPU for refresh in ("per_layer", "per_step")),
    *(case("cuda", torch.bfloat16, dict(**shape, refresh="per_step", sliding=True), id="per_step-sliding-" + shape_id(torch.bfloat16, **shape))
      for _, shape in GPU[:1]),
])
def test_drafter_pass(device, dtype, kw):
    check_drafter_pass(device, dtype, **kw)


def check_drafter_first_pass_uniform(monkeypatch, device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                                     seq_lens=(3000, 900, 5000, 1400), layers=2, retention=0.15, keys=True,
                                     top_k="auto"):
    """``sfi.mode lossless`` with one token per row in the drafter's first pass (``drafter_kv:
    shared``): the pass that re-selects is a uniform launch, which the drafter's CUDA graph can
    hold. :func:`~sfi_vllm.lossless.plan_draft` puts its slow rows inside the launch, the metadata
    build makes the uniform tables, the fast-step kernel attends (densely at a request's first
    selection; with ``slow_attention: keys`` then through the set it has) and stages the queries,
    and the next pass's build runs the refresh. Against the reference layers' eager path over the
    same queries: the slow rows' outputs, and the sets layer by layer. Two verify cycles: a first
    selection, then a re-selection."""
    from dataclasses import dataclass

    import numpy as np
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from sfi_vllm.attention_ref import dense_attention
    from sfi_vllm.backends.common import FastRows, SFIStep, attach_fast_tables, make_step
    from sfi_vllm.backends.common import uniform_table_rows
    from sfi_vllm.backends.cuda import SFIFlashMetadataBuilder
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.backends.step_refresh import FusedScoreBuffers
    from sfi_vllm.kernels.fast_decode import uniform_workspace_numel
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import FakeCAM, plan_for

    n = len(seq_lens)
    base = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", retention, max(seq_lens)),
            "slow_attention": "keys" if keys else "dense"}
    tokens = n * SlowStepSelection.frame_width(max(seq_lens))
    (ref_ctl, ctl), stacks = refresh_stacks([with_top_k({**base, "slow_refresh": "per_layer"}, "torch"),
                                             {**with_top_k(base, top_k), "mode": "lossless", "slow_refresh": "per_step",
                                              "slow_in_graph": True, "fused_scores_tokens": tokens}],
                                            hq, hkv, d, dtype, device, layers)
    ctl.executor.graph_slow_ready = True  # as the CUDA impl sets them up
    ctl.executor.fused_scores = FusedScoreBuffers.allocate(tokens, layers, hq, hkv, device)

    @dataclass
    class Meta:  # the platform metadata's fields: none needed here
        sfi: SFIStep | None = None
        sfi_uniform: FastRows | None = None
        sfi_planned: bool = False

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "build", lambda self, cpl, cam, fast_build=False: Meta())
    builder = object.__new__(SFIFlashMetadataBuilder)
    builder.metadata_cls = Meta
    builder.controller = ctl
    builder._uniform_ok = True
    # the drafter's graph pads the batch by one row (drafter_graphs): the build asks vLLM's
    # dispatcher for the padding, and the tables it makes then serve the graph's decision
    padded = n + 1
    builder._row_tables = torch.zeros(uniform_table_rows(True, ctl.cfg.balanced_splits), padded, dtype=torch.int32,
                                      device=device)
    builder._kv_heads = hkv
    builder._graph_seq_lens = torch.zeros(padded, dtype=torch.int32, device=device)
    builder._graph_block_table = None
    from vllm.config import CUDAGraphMode

    from sfi_vllm.patches.drafter_graphs import decide, first_pass_graph_rows

    dispatcher = SimpleNamespace(dispatch=lambda rows: (CUDAGraphMode.PIECEWISE, SimpleNamespace(num_tokens=rows + 1)))
    proposer = SimpleNamespace(model=object(), method="draft_model", cudagraph_dispatcher=dispatcher)
    ctl.first_pass_rows = lambda c: first_pass_graph_rows(ctl, proposer, c)  # what the propose wrapper sets
    ws = torch.empty(uniform_workspace_numel(n + 1, hq, hkv, d, balanced=ctl.cfg.balanced_splits), dtype=torch.float32,
                     device=device)

    paged, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=5)
    pageds = [PagedKV(paged.kv_cache.clone(), "flash", d) for _ in range(layers)]
    for layer, p in zip(stacks[1], pageds):
        layer.stage = torch.full((n, hq, d), float("nan"), dtype=dtype, device=device)
        layer.kv = p.nhd_views()
    g = torch.Generator().manual_seed(17)

    def one_token_cam(contexts):
        ar = torch.arange(n + 1, dtype=torch.int32)
        return FakeCAM(num_reqs=n, num_actual_tokens=n, max_query_len=1, query_start_loc_cpu=ar,
                       query_start_loc=ar.to(device), seq_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
                       block_table_tensor=cam.block_table_tensor, slot_mapping=torch.arange(n, device=device))

    ids = [f"r{i}" for i in range(n)]
    z = torch.zeros(n, dtype=torch.long)
    # contexts of the two first passes: every draft kept, 5 and then 4 tokens verified per cycle
    first = [s - 5 for s in seq_lens]
    prompt = [c - 6 for c in first]
    ctl.plan_step(ids, np.array(prompt), np.zeros(n, dtype=np.int64), prompt, z)
    for cycle, (computed, contexts) in enumerate(((prompt, first), (first, list(seq_lens)))):
        ctl.plan_step(ids, np.full(n, 5), np.array(computed), prompt, z)  # the model's verify step
        fcam = one_token_cam(contexts)
        proposer._sfi_decisions = 0  # what the propose wrapper sets
        meta = builder.build_for_drafting(fcam, 0)
        plan = ctl.draft_plans[0][1]
        assert ctl.draft_graph is not None and ctl.draft_graph[0] == padded and meta.sfi_uniform.rows == padded
        assert meta.sfi_uniform.splits is not None  # balanced splits, the default
        assert decide(proposer, ctl, CUDAGraphMode.PIECEWISE, padded, None)[0] == CUDAGraphMode.FULL
        # a second attention group's build of the same pass runs nothing staged: the pass's own
        # slow rows are refreshed after its forward
        finished = []
        ctl.executor.finish = lambda layers: finished.append(layers)  # the instance's, for this build only
        builder.build_for_drafting(fcam, 0)
        del ctl.executor.finish
        assert finished == [] and ctl.executor.has_staged_work
        on_set = keys and cycle > 0
        assert plan.modes == [StepMode.SLOW] * n and plan.graph_slow and not plan.needs_eager
        assert plan.keys_only == ([True] * n if on_set else None)
        assert meta.sfi is None and meta.sfi_uniform is not None and meta.sfi_planned
        # the reference: the same pass as an eager slow step, refreshed per layer
        ref_plan = plan_for([StepMode.SLOW] * n, cfg=ref_ctl.cfg, context=contexts)
        ref_plan.generations = list(plan.generations)
        ref_plan.keys_only = plan.keys_only
        step = make_step(ref_plan, fcam, lambda s: None)
        if on_set:
            attach_fast_tables(step, fcam, ref_ctl)
        for li in range(layers):
            q = torch.randn(n, hq, d, generator=g).to(device, dtype)
            want = torch.full_like(q, float("nan"))
            if on_set:
                stacks[0][li].fast(step, pageds[li], q, want)
            else:
                for r in range(n):
                    kk, vv = pageds[li].gather_range(cam.block_table_tensor[r], 0, contexts[r])
                    want[r] = dense_attention(q[r], kk, vv, d ** -0.5).to(dtype)
            stacks[0][li].refresh(step, pageds[li], q, li)
            out = torch.full_like(q, float("nan"))
            stacks[1][li].fast_uniform(meta.sfi_uniform, pageds[li], q, out, ws)
            assert torch.equal(stacks[1][li].stage[:n], q), "query staging"
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 2e-2, (cycle, li, err)
        ref_ctl.end_step()
        ref_ctl.executor.join_refresh()
        # the next pass's build runs the refresh of the rows that re-selected
        assert ctl.executor.has_staged_work
        builder.build_for_drafting(one_token_cam([c + 1 for c in contexts]), 1)
        assert not ctl.executor.has_staged_work
        ctl.executor.join_refresh()
        assert ctl.draft_plans[1][1].modes == [StepMode.FAST] * n
        assert_same_sets(stacks[0], stacks[1], n)
        ctl.end_step()


@pytest.mark.parametrize("device,dtype,kw", [
    # on the CPU the keys case only: its first cycle is a dense first selection (the dense
    # re-selection inside the launch is check_graph_slow's)
    case("cpu", torch.float32, dict(**CPU_SHAPE, seq_lens=CPU_ROWS, top_k="torch"),
         id="keys-" + shape_id(torch.float32, **CPU_SHAPE)),
    *(case("cuda", dtype, dict(**shape, keys=keys), id=f"{'keys' if keys else 'dense'}-" + shape_id(dtype, **shape))
      for dtype, shape in GPU[:2] for keys in (True, False)),
])
def test_drafter_first_pass_uniform(monkeypatch, device, dtype, kw):
    check_drafter_first_pass_uniform(monkeypatch, device, dtype, **kw)


@pytest.mark.parametrize("on", [False, True])
def test_wide_dense_tiles_setting_gates_the_launch(on):
    """``sfi.experimental.wide_dense_tiles``: off, no launch takes wide tiles; on, dense rows of at
    least WIDE_DENSE_FROM keys take them in launches of at most WIDE_DENSE_MAX_ROWS rows (the
    launch itself: check_packed_layer)."""
    from sfi_vllm.backends import packed_layer as pl
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from test_sfi_layer import fake_vllm_config

    over = {"boundary_token_ids": [7], "experimental": {"wide_dense_tiles": on}}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    packed = PackedCompactBuffer(2, 3, ctl.cfg.compact_capacity(8192), 32, torch.float32, "cpu")
    layer = pl.PackedSFILayer(ctl, 6, 3, 32, scale=32 ** -0.5, packed=packed)
    assert layer.wide_dense_from == (pl.WIDE_DENSE_FROM if on else 0)
    tiles = [layer.wide_tile(rows) for rows in (1, pl.WIDE_DENSE_MAX_ROWS, pl.WIDE_DENSE_MAX_ROWS + 1, 16)]
    assert tiles == ([pl.WIDE_DENSE_TILE, pl.WIDE_DENSE_TILE, 0, 0] if on else [0, 0, 0, 0])


@pytest.mark.parametrize("on", [False, True])
def test_one_wave_splits_setting_picks_the_split_rule(on):
    """``sfi.experimental.one_wave_splits`` (with ``balanced_splits`` off, which it needs): off,
    uniform launches take the smallest split count whose programs reach 528; on, the largest whose
    programs stay within 528 (never more than off, so the shared workspace holds both)."""
    from sfi_vllm.backends import packed_layer as pl
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.kernels.fast_decode import uniform_num_splits
    from test_sfi_layer import fake_vllm_config

    over = {"boundary_token_ids": [7], "balanced_splits": False, "experimental": {"one_wave_splits": on}}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    packed = PackedCompactBuffer(2, 3, ctl.cfg.compact_capacity(8192), 32, torch.float32, "cpu")
    layer = pl.PackedSFILayer(ctl, 6, 3, 32, scale=32 ** -0.5, packed=packed)
    assert layer.one_wave_splits is on
    # 8 KV heads: 1, 6, 8, 16 and 100 rows
    got = [uniform_num_splits(rows, 8, one_wave=on) for rows in (1, 6, 8, 16, 100)]
    assert got == ([64, 11, 8, 4, 1] if on else [64, 11, 9, 5, 1])
    for rows in range(1, 80):
        n = uniform_num_splits(rows, 8, one_wave=True)
        assert n <= uniform_num_splits(rows, 8)
        assert rows * 8 * n <= 528 or n == 1
