"""The per-layer SFI work (refresh + fast step) over a real paged cache, without vLLM's engine:
batches mixing prefill, dense, slow and fast rows, padded rows, GQA, block sizes 16 and 128."""

from types import SimpleNamespace

import pytest
import torch

from sfi_vllm.attention_ref import attention_probs
from sfi_vllm.backends.common import SFILayer, make_step, subset_common_metadata
from sfi_vllm.backends.cuda_executor import executor_for
from sfi_vllm.compact import selected_count, window_start
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController, StepPlan
from sfi_vllm.paged_kv import PagedKV
from sfi_vllm.selector import Selector
from sfi_vllm.trigger import StepMode
from test_attention_ref import brute_force


def fake_vllm_config(sfi: dict, max_num_seqs: int = 8, max_model_len: int | None = None, kv_heads: int = 8,
                     head_size: int = 128):
    """The parts of a VllmConfig the controller reads. ``max_model_len`` and the model shape size the
    compact-set pool, which the controller builds on CUDA or with ``compact_memory_gib`` (the
    defaults: the largest head shape the tests use); without ``max_model_len`` requests are not
    checked against a longest context."""
    sfi = {"boundary_token_ids": [7], **sfi}
    model = dict(get_vocab_size=lambda: 16, skip_tokenizer_init=True, dtype=torch.bfloat16,
                 get_num_layers=lambda parallel: 1, get_num_kv_heads=lambda parallel: kv_heads,
                 get_head_size=lambda: head_size)
    if max_model_len is not None:
        model["max_model_len"] = max_model_len
    return SimpleNamespace(
        additional_config={"sfi": sfi},
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(**model),
        parallel_config=SimpleNamespace(rank=0),
    )


class FakeCAM(SimpleNamespace):
    def replace(self, **kw):
        return FakeCAM(**{**self.__dict__, **kw})


def make_batch(layout, block_size, seq_lens, query_lens, hq=9, hkv=3, d=64, seed=0):
    """A paged cache holding every row's context, plus the step's queries."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [(s + block_size - 1) // block_size for s in seq_lens]
    nb = sum(blocks_per) + 3
    if layout == "flash":
        cache = torch.zeros(nb, block_size, hkv, 2 * d).permute(0, 2, 1, 3)
        paged = PagedKV(cache, "flash", d)
    else:
        from sfi_vllm.paged_kv import transposed_key_order

        cache = torch.zeros(nb, hkv, block_size, 2 * d)
        paged = PagedKV(cache, "cpu", d, transposed_key_order(block_size, d))
    perm = torch.randperm(nb, generator=g)
    width = max(blocks_per)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    ks, vs = [], []
    used = 0
    for i, s in enumerate(seq_lens):
        row = perm[used : used + blocks_per[i]]
        used += blocks_per[i]
        bt[i, : len(row)] = row
        # keys with a few strongly attended positions, like real heads
        k = torch.randn(s, hkv, d, generator=g)
        v = torch.randn(s, hkv, d, generator=g)
        pos = torch.arange(s)
        paged.write(row[pos // block_size] * block_size + pos % block_size, k, v)
        ks.append(k)
        vs.append(v)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    cam = FakeCAM(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=bt, slot_mapping=torch.arange(int(qsl[-1])),
        positions=None,
    )
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return paged, cam, q, ks, vs


def plan_for(modes, slots=None, refresh_all=None, cfg=None, context=None):
    n = len(modes)
    cfg = cfg or build_config({"bridge_steps": 0, "boundary_token_ids": [7]}, use_env=False)
    return StepPlan(
        num_reqs=n, req_ids=[f"r{i}" for i in range(n)], slots=slots or list(range(n)),
        generations=[1] * n, modes=[int(m) for m in modes], reasons=[1 if m == StepMode.SLOW else 0 for m in modes],
        refresh_all=refresh_all or [True] * n, slow_counts=[0] * n, configs=[cfg] * n, context=context,
    )


def test_subset_common_metadata_picks_rows_and_tokens():
    _, cam, _, _, _ = make_batch("flash", 16, [40, 70, 33, 90], [1, 5, 1, 3])
    sub, tok = subset_common_metadata(cam, [1, 3])
    assert tok.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert sub.query_start_loc_cpu.tolist() == [0, 5, 8]
    assert sub.seq_lens.tolist() == [70, 90] and sub.num_reqs == 2 and sub.num_actual_tokens == 8
    assert torch.equal(sub.block_table_tensor, cam.block_table_tensor[[1, 3]])
    assert sub.slot_mapping.tolist() == tok.tolist()


def test_make_step_splits_rows_and_pads():
    _, cam, _, _, _ = make_batch("flash", 16, [40, 70, 33, 90, 20], [1, 1, 1, 7, 1])
    plan = plan_for([StepMode.FAST, StepMode.SLOW, StepMode.DENSE, StepMode.PREFILL])  # row 4: padding
    built = []
    step = make_step(plan, cam, lambda sub: built.append(sub) or "kernel-meta")
    assert step.fast_rows == [0] and step.slow_rows == [1] and step.kernel_rows == [1, 2, 3, 4]
    assert step.kernel_metadata == "kernel-meta" and built[0].num_reqs == 4
    assert step.kernel_token_idx.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    all_fast = make_step(plan_for([StepMode.FAST] * 5), cam, lambda s: 1 / 0)
    assert all_fast.kernel_metadata is None and all_fast.kernel_rows == []


def _run_layer(sfi_cfg, layout, block_size, seq_lens, query_lens, modes):
    ctl = SFIController(build_config({"bridge_steps": 0, "boundary_token_ids": [7], **sfi_cfg}, use_env=False), fake_vllm_config(sfi_cfg))
    layer = SFILayer(ctl, num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    paged, cam, q, ks, vs = make_batch(layout, block_size, seq_lens, query_lens)
    # slow step on every decode row first, then a fast step at the same context
    slow = make_step(plan_for([StepMode.SLOW if m == StepMode.FAST else m for m in modes], cfg=ctl.cfg), cam, lambda s: None)
    layer.refresh(slow, paged, q, layer_idx=0)
    fast = make_step(plan_for(modes, cfg=ctl.cfg), cam, lambda s: None)
    out = torch.full_like(q, float("nan"))
    layer.fast(fast, paged, q, out)
    return ctl, layer, paged, cam, q, ks, vs, out


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_fast_step_equals_dense_when_budget_covers_context(layout, block_size):
    """context <= sinks + K + window  =>  a fast step is dense attention."""
    cfg = {"sinks": 4, "recent_window": 64, "selected_tokens": 200, "min_gap": 0}
    seq_lens, qlens = [268, 150, 500, 90], [1, 1, 9, 1]
    modes = [StepMode.FAST, StepMode.FAST, StepMode.PREFILL, StepMode.FAST]
    *_, cam, q, ks, vs, out = _run_layer(cfg, layout, block_size, seq_lens, qlens, modes)
    for row in (0, 1, 3):
        t = int(cam.query_start_loc_cpu[row])
        ref = brute_force(q[t], ks[row].permute(1, 0, 2), vs[row].permute(1, 0, 2), 0.125)
        assert torch.allclose(out[t].double(), ref, atol=1e-5)
    assert torch.isnan(out[2]).all()  # prefill rows are left to the dense kernel


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_fast_step_with_small_budget_attends_exactly_the_working_set(layout):
    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 24, "min_gap": 0}
    ctl, layer, paged, cam, q, ks, vs, out = _run_layer(
        cfg, layout, 16, [700, 333], [1, 1], [StepMode.FAST, StepMode.FAST]
    )
    c = build_config(cfg, use_env=False)
    sel = Selector(c.selector)
    for row, ctx in enumerate([700, 333]):
        t = int(cam.query_start_loc_cpu[row])
        k_all, v_all = ks[row].permute(1, 0, 2), vs[row].permute(1, 0, 2)
        ws = window_start(c, ctx)
        kk = selected_count(c, ctx)
        assert kk == 24 and ws == ((ctx - 32) // 16) * 16
        probs = attention_probs(q[t], k_all, 0.125)
        chosen = sel.select(probs, k_all[:, 4:ws].norm(dim=-1), 4, ws, kk)
        entry = layer.buffer.get(row, 1)
        assert torch.equal(entry.positions[:, 4:], chosen)
        keep = [torch.cat([torch.arange(4), chosen[h], torch.arange(ws, ctx)]) for h in range(3)]
        ref = brute_force(q[t], k_all, v_all, 0.125, keep)
        assert torch.allclose(out[t].double(), ref, atol=1e-5)
        dense = brute_force(q[t], k_all, v_all, 0.125)
        assert not torch.allclose(out[t].double(), dense, atol=1e-3)
    st = ctl.stats.get("r0")
    assert st.fast_layer_evals == 1 and st.fast_attended_tokens == 4 + 24 + (700 - ((700 - 32) // 16) * 16)


def test_candidate_pages_restrict_the_reference_refresh_to_the_pages_of_highest_bound():
    """sfi.experimental.candidate_pages: the refresh selects as the Selector does over the candidate
    pages of each KV head (quest bounds of the row's own query), and only from them."""
    from sfi_vllm.selector import candidate_page_mask, quest_page_bounds

    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 48, "min_gap": 0,
           "experimental": {"candidate_pages": 2}}
    ctl, layer, paged, cam, q, ks, vs, out = _run_layer(cfg, "flash", 16, [900], [1], [StepMode.FAST])
    c = build_config(cfg, use_env=False)
    k_all = ks[0].permute(1, 0, 2)
    ws, kk = window_start(c, 900), selected_count(c, 900)
    mask = candidate_page_mask(quest_page_bounds(q[0], k_all, 4, ws, 16, 0.125), kk, 2, c.selector)
    assert mask.sum(1).tolist() == [6, 6, 6]  # 2 x ceil(48 / 16) pages of 54 per head
    chosen = Selector(c.selector).select(attention_probs(q[0], k_all, 0.125), k_all[:, 4:ws].norm(dim=-1),
                                         4, ws, kk, candidates=mask)
    got = layer.buffer.get(0, 1).positions[:, 4:]
    assert torch.equal(got, chosen)
    assert all(bool(mask[h, (got[h] - 4) // 16].all()) for h in range(3))
    # the whole-context selection takes pages outside the candidates here: the option changed it
    ctl_all, layer_all, *_ = _run_layer({**cfg, "experimental": {}}, "flash", 16, [900], [1], [StepMode.FAST])
    assert not torch.equal(layer_all.buffer.get(0, 1).positions[:, 4:], got)


@pytest.mark.parametrize("window_mode", ["grow", "slide"])
def test_a_multi_token_fast_row_attends_causally_for_each_token(window_mode):
    """A drafter's first pass without re-selection (sfi.mode lossless, draft_reselect reuse_budget):
    one row holds several tokens, each a fast step on the compact set and the window up to itself;
    the tokens after the row's last real one (rejected drafts) get zeros."""
    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 24, "min_gap": 0, "window_mode": window_mode}
    ctl = SFIController(build_config({"bridge_steps": 0, "boundary_token_ids": [7], **cfg}, use_env=False),
                        fake_vllm_config(cfg))
    c = ctl.cfg
    layer = SFILayer(ctl, num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    ctx = 400
    paged, cam, q, ks, vs = make_batch("flash", 16, [ctx], [6])  # 6 tokens: 4 real, 2 padding
    slow = plan_for([StepMode.SLOW], cfg=c, context=[ctx - 20])  # selected 20 tokens ago, from token 0
    layer.refresh(make_step(slow, cam, lambda s: None), paged, q, layer_idx=0)
    entry = layer.buffer.get(0, 1)
    fast = plan_for([StepMode.FAST], cfg=c, context=[ctx - 2])
    fast.query_tokens = [3]  # the row's last real token; tokens 0-3 sit at contexts ctx-5 .. ctx-2
    out = torch.full_like(q, float("nan"))
    layer.fast(make_step(fast, cam, lambda s: None), paged, q, out)
    k_all, v_all = ks[0].permute(1, 0, 2), vs[0].permute(1, 0, 2)
    for u in range(4):
        ctx_u = ctx - 5 + u
        ws = max(entry.window_start, window_start(c, ctx_u)) if window_mode == "slide" else entry.window_start
        keep = [torch.cat([entry.positions[h], torch.arange(ws, ctx_u)]) for h in range(3)]
        ref = brute_force(q[u], k_all, v_all, 0.125, keep)
        assert torch.allclose(out[u].double(), ref, atol=1e-5), u
    assert (out[4:6] == 0).all()
    assert ctl.stats.get("r0").fast_layer_evals == 4


def test_fast_step_without_compact_set_is_an_error():
    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 24, "min_gap": 0}
    ctl = SFIController(build_config({"bridge_steps": 0, "boundary_token_ids": [7], **cfg}, use_env=False), fake_vllm_config(cfg))
    layer = SFILayer(ctl, 9, 3, 64, 0.125)
    paged, cam, q, _, _ = make_batch("flash", 16, [300], [1])
    with pytest.raises(RuntimeError, match="no compact set"):
        layer.fast(make_step(plan_for([StepMode.FAST], cfg=ctl.cfg), cam, lambda s: None), paged, q, torch.empty_like(q))


def test_controller_plans_rows_and_recycles_slots():
    cfg = {"bridge_steps": 0, "reuse_budget": 3, "min_gap": 0, "boundary_token_ids": [7]}
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg, max_num_seqs=2))
    import numpy as np

    p = ctl.plan_step(["a", "b"], np.array([10, 1]), np.array([0, 50]), [10, 40], torch.tensor([1, 2]))
    assert p.modes == [StepMode.PREFILL, StepMode.SLOW] and p.slots == [0, 1]
    p = ctl.plan_step(["a", "b"], np.array([1, 1]), np.array([10, 51]), [10, 40], torch.tensor([3, 7]))
    assert p.modes == [StepMode.SLOW, StepMode.FAST]
    p = ctl.plan_step(["a", "b"], np.array([1, 1]), np.array([11, 52]), [10, 40], torch.tensor([3, 3]))
    assert p.modes == [StepMode.FAST, StepMode.SLOW]  # boundary after token 7
    ctl.on_scheduler_output(SimpleNamespace(finished_req_ids={"a"}, preempted_req_ids=None))
    p = ctl.plan_step(["c"], np.array([5]), np.array([0]), [5], torch.tensor([1]))
    assert p.slots == [0] and ctl.stats.finished["a"].slow_steps == 1
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        ctl.plan_step(["c", "b", "d"], np.array([1, 1, 1]), np.array([5, 53, 3]), [5, 40, 3], torch.tensor([1, 1, 1]))


def test_fused_scores_lay_out_each_group_of_slow_rows_or_count_a_miss():
    import numpy as np

    from sfi_vllm.backends.step_refresh import FusedScoreBuffers, score_row_tables

    cfg = {"bridge_steps": 0, "reuse_budget": 3, "min_gap": 0, "boundary_token_ids": [7], "sinks": 4, "recent_window": 64,
           "selected_tokens": 128, "fused_scores_tokens": 8192, "slow_attention": "dense"}
    # slow_attention keys (the default): the same frames, scored by the refresh after the step,
    # so the fast-step kernel's tables score no row
    keys = SFIController(build_config({**cfg, "slow_attention": "keys"}, use_env=False),
                         fake_vllm_config(cfg, max_num_seqs=4))
    executor_for(keys).graph_slow_ready = True
    keys.executor.fused_scores = FusedScoreBuffers.allocate(8192, 3, 6, 2, "cpu")
    p = keys.plan_step(["a", "c"], np.array([1, 1]), np.array([1000, 2500]), [1000, 2500], torch.tensor([1, 1]))
    assert p.graph_slow and p.score_layout == {(keys.cfg.selector, 4, False): (0, 4096, False)}
    assert score_row_tables(p, 3)[0].tolist() == [-1, -1, -1]
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg, max_num_seqs=4))
    executor = executor_for(ctl)  # as the CUDA impl attaches it
    executor.graph_slow_ready = True
    layers, hq, hkv = 3, 6, 2
    executor.fused_scores = FusedScoreBuffers.allocate(8192, layers, hq, hkv, "cpu")
    # a (1001 tokens) and c (2501) take their first slow step: one group (same Selector and
    # sinks), a frame of 4096 tokens (the larger context rounded up to 2048) for each row
    p = ctl.plan_step(["a", "c"], np.array([1, 1]), np.array([1000, 2500]), [1000, 2500], torch.tensor([1, 1]))
    assert p.graph_slow and p.context == [1001, 2501]
    assert p.score_layout == {(ctl.cfg.selector, 4, True): (0, 4096, True)}  # slow_attention dense: the kernel scores
    # base, layer stride and width per row; a padding row past the batch has base -1
    assert score_row_tables(p, 3).tolist() == [[0, 4096, -1], [8192, 8192, 0], [4096, 4096, 0]]
    logits, norms = executor.fused_scores.views(0, 2, 4096)
    assert logits.shape == (layers, 2, hkv, hq // hkv, 4096) and norms.shape == (layers, 2, hkv, 4096)
    # layer l, row j's frame starts at frame token base_j + l * stride, where the kernel writes it
    assert logits[1, 1].data_ptr() == executor.fused_scores.logits[(4096 + 8192) * hq:].data_ptr()
    assert norms[2, 0].data_ptr() == executor.fused_scores.norms[(0 + 2 * 8192) * hkv:].data_ptr()
    assert executor.fused_score_misses == 0
    # the uniform step's persistent tables: every padding row past the batch loses a stale base
    from types import SimpleNamespace

    from sfi_vllm.backends.common import uniform_tables

    from sfi_vllm.backends.common import balanced_split_table, row_keys, uniform_table_rows
    from sfi_vllm.kernels.fast_decode import balanced_row_splits

    assert ctl.cfg.balanced_splits and uniform_table_rows(True, True) == 6  # the default: split counts last
    persistent = torch.full((6, 4), 7, dtype=torch.int32)
    cam = SimpleNamespace(num_reqs=2, seq_lens=torch.tensor([1001, 2501]), block_table_tensor=torch.zeros(2, 1))
    tables = uniform_tables(p, cam, persistent, ctl, hkv)
    # both rows slow with dense attention (no set yet): each reads its whole context; 528 programs
    # over 3,502 keys x 2 KV heads make 32-key programs (one tile), at most 64 a row
    assert row_keys(p, [True, True]) == [1001, 2501]
    assert balanced_row_splits([1001, 2501], hkv) == [32, 64]
    assert persistent[5].tolist() == [32, 64, 1, 1]  # padding rows: 1
    assert persistent[:5].tolist() == [[-1, -1, 7, 7], [0, 0, 7, 7], [0, 4096, -1, -1], [8192, 8192, 0, 0],
                                       [4096, 4096, 0, 0]]
    assert tables.scores is not None and tables.scores[0].data_ptr() == persistent[2].data_ptr()
    assert tables.splits is not None and tables.splits.data_ptr() == persistent[5].data_ptr()
    assert balanced_split_table(p, 2, 4, hkv, [True, True]).tolist() == persistent[5].tolist()
    # d and e (1001 and 4201 tokens) need two frames of 6144 tokens: more than the buffers hold,
    # so the step scores them in a second pass, and the miss is counted
    p = ctl.plan_step(["d", "e"], np.array([1, 1]), np.array([1000, 4200]), [1000, 4200], torch.tensor([1, 1]))
    assert p.graph_slow and p.score_layout is None and executor.fused_score_misses == 1
    assert score_row_tables(p, 2)[0].tolist() == [-1, -1]


def test_fused_score_frames_of_a_mixed_step_kernel_scored_groups_first():
    """A uniform step with slow rows of slow_attention dense requests (scored by the fast-step
    kernel) and of keys requests (scored by the refresh after the step): the kernel's group gets
    the first frames and the only table entries; a group that no longer fits gets no frame (the
    refresh scores it from its scratch) and the step is counted as a miss."""
    from sfi_vllm.backends.step_refresh import FusedScoreBuffers, plan_score_frames, graph_slow_groups, score_row_tables

    keys_cfg = build_config({"bridge_steps": 0, "boundary_token_ids": [7]}, use_env=False)
    dense_cfg = build_config({"bridge_steps": 0, "boundary_token_ids": [7], "slow_attention": "dense"}, use_env=False)
    plan = plan_for([StepMode.SLOW] * 4, cfg=keys_cfg, context=[3000, 1000, 5000, 900])
    plan.configs = [keys_cfg, dense_cfg, keys_cfg, dense_cfg]
    plan.keys_only = [True, False, True, False]
    groups = graph_slow_groups(plan)
    sel = keys_cfg.selector
    assert groups == {(sel, 4, False): [0, 2], (sel, 4, True): [1, 3]}
    layers = 2
    # room for both: the kernel's group (2 rows x 2048 x 2 layers) first, then the keys group (2 x 6144 x 2)
    both = FusedScoreBuffers.allocate(2 * 2048 + 2 * 6144, layers, 6, 2, "cpu")
    layout, missed = plan_score_frames(groups, plan.context, both)
    assert missed == 0 and layout == {(sel, 4, True): (0, 2048, True), (sel, 4, False): (8192, 6144, False)}
    plan.score_layout = layout
    assert score_row_tables(plan, 5).tolist() == [[-1, 0, -1, 2048, -1], [0, 4096, 0, 4096, 0],
                                                  [0, 2048, 0, 2048, 0]]
    # room for either group alone: the kernel's gets it, the keys group has no frame (the refresh
    # scores it from its scratch), and the executor counts the step as a miss
    from sfi_vllm.backends.cuda_executor import CudaExecutor

    small = FusedScoreBuffers.allocate(2 * 6144, layers, 6, 2, "cpu")
    layout, missed = plan_score_frames(groups, plan.context, small)
    assert missed == 1 and layout == {(sel, 4, True): (0, 2048, True)}
    executor = CudaExecutor(keys_cfg)
    executor.fused_scores = small
    plan.score_layout = executor._score_layout(plan)
    assert plan.score_layout == layout and executor.fused_score_misses == 1
    assert score_row_tables(plan, 4)[0].tolist() == [-1, 0, -1, 2048]
    # room for nothing: no layout at all
    tiny = FusedScoreBuffers.allocate(2048, layers, 6, 2, "cpu")
    executor.fused_scores = tiny
    assert executor._score_layout(plan) is None and executor.fused_score_misses == 2


def test_slow_in_graph_plans_only_steps_whose_slow_rows_can_be_refreshed_after_the_step():
    import numpy as np

    cfg = {"reuse_budget": 3, "min_gap": 0, "boundary_token_ids": [7], "sinks": 4, "recent_window": 64,
           "selected_tokens": 128}

    def controller(extra, staged=True):
        c = {**cfg, **extra}
        ctl = SFIController(build_config({"bridge_steps": 0, **c}, use_env=False), fake_vllm_config(c, max_num_seqs=4))
        executor_for(ctl).graph_slow_ready = staged  # what the CUDA impl sets when its layers stage queries
        return ctl

    for extra in ({}, {"slow_in_graph": True}):  # unset (the default) and true plan the same
        ctl = controller(extra)
        # a's first decode step at 1000 tokens: the Selector runs -> in the graph
        p = ctl.plan_step(["a"], np.array([1]), np.array([1000]), [1000], torch.tensor([1]))
        assert p.modes == [StepMode.SLOW] and p.graph_slow and not p.needs_eager
        # b's context (150) leaves fewer candidates than K: no selection to run -> eager, for the whole step
        p = ctl.plan_step(["a", "b"], np.array([1, 1]), np.array([1001, 150]), [1000, 150], torch.tensor([7, 1]))
        assert p.modes == [StepMode.FAST, StepMode.SLOW] and not p.graph_slow and p.needs_eager
    # off, excluded by the refresh mode or interleaving, or no backend staging queries (CPU, torch
    # kernels): slow steps stay eager
    for extra, staged in (({"slow_in_graph": False}, True), ({"slow_refresh": "per_layer"}, True),
                          ({"layer_interleaved_refresh": True}, True), ({}, False)):
        ctl = controller(extra, staged)
        p = ctl.plan_step(["a"], np.array([1]), np.array([1000]), [1000], torch.tensor([1]))
        assert p.modes == [StepMode.SLOW] and not p.graph_slow and p.needs_eager, extra


def test_new_controller_callbacks_fire_for_each_new_controller_and_an_existing_one():
    """The plugin installs the model runner's hooks through this (sfi_vllm.plugin)."""
    from sfi_vllm import controller as controller_module

    seen = []
    controller_module.reset_controller()
    try:
        first = controller_module.get_controller(fake_vllm_config({"bridge_steps": 0}))
        controller_module.on_new_controller(seen.append)  # registered after: called for it at once
        assert seen == [first]
        second = controller_module.get_controller(fake_vllm_config({"bridge_steps": 0}))  # a new engine
        assert second is not first and seen == [first, second]
        controller_module.on_new_controller(seen.append)  # once per callback
        assert seen == [first, second]
    finally:
        controller_module._ON_NEW_CONTROLLER.remove(seen.append)
        controller_module.reset_controller()


def test_gpu_refresh_timings_are_observed_once_complete_oldest_first_per_layer():
    """The kernel path times its refresh with CUDA events and reads them back without waiting:
    a timing is observed once its end event has completed, as one share per layer it covered."""
    from sfi_vllm.backends.cuda_executor import CudaExecutor

    class Event:
        def __init__(self, t_ms, done=True):
            self.t_ms, self.done = t_ms, done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.t_ms - self.t_ms

    seen = []
    ex = CudaExecutor(build_config({}, use_env=False), seen.append)
    with ex.timed(torch.device("cpu"), 3):  # the CPU reference path times itself: nothing queued
        pass
    assert not ex._timings
    late = Event(30.0, done=False)
    ex._timings.extend([(Event(0.0), Event(6.0), 3), (Event(10.0), late, 1), (Event(40.0), Event(41.0), 1)])
    ex.collect_timings()
    assert seen == [0.002, 0.002, 0.002] and len(ex._timings) == 2  # the second has not finished: wait
    late.done = True
    ex.collect_timings()
    assert seen[3:] == [0.02, 0.001] and not ex._timings


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_keys_only_slow_row_attends_its_old_set_then_refreshes(layout):
    """``slow_attention: keys``: a slow row that has a compact set is a fast row for its own token
    (its set chosen at the last slow step, and the window) and is re-selected from this step's
    query, as a dense slow row would be; make_step sends it to the fast rows and the refresh, not
    to the dense kernel."""
    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 24, "min_gap": 0, "slow_attention": "keys"}
    ctl = SFIController(build_config({"bridge_steps": 0, "boundary_token_ids": [7], **cfg}, use_env=False),
                        fake_vllm_config(cfg))
    c = ctl.cfg
    layer = SFILayer(ctl, num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    ctx = 600
    paged, cam, q, ks, vs = make_batch(layout, 16, [ctx], [1])
    earlier = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))  # the last slow step's query
    layer.refresh(make_step(plan_for([StepMode.SLOW], cfg=c, context=[ctx]), cam, lambda s: None), paged,
                  earlier, layer_idx=0)
    old = layer.buffer.get(0, 1).positions.clone()
    plan = plan_for([StepMode.SLOW], cfg=c, context=[ctx])
    plan.reasons, plan.refresh_all, plan.keys_only = [2], [False], [True]  # a reuse-budget slow step
    step = make_step(plan, cam, lambda s: 1 / 0)
    assert step.fast_rows == [0] and step.slow_rows == [0] and step.kernel_rows == []
    out = torch.full_like(q, float("nan"))
    layer.fast(step, paged, q, out)  # the order of the impl's forward: attention, then the refresh
    layer.refresh(step, paged, q, layer_idx=0)
    k_all, v_all = ks[0].permute(1, 0, 2), vs[0].permute(1, 0, 2)
    ws = window_start(c, ctx)
    keep = [torch.cat([old[h], torch.arange(ws, ctx)]) for h in range(3)]
    assert torch.allclose(out[0].double(), brute_force(q[0], k_all, v_all, 0.125, keep), atol=1e-5)
    new = layer.buffer.get(0, 1).positions
    want = Selector(c.selector).select(attention_probs(q[0], k_all, 0.125), k_all[:, 4:ws].norm(dim=-1), 4, ws, 24)
    assert torch.equal(new[:, 4:], want) and not torch.equal(new, old)
    assert ctl.stats.get("r0").fast_layer_evals == 0  # counted as a slow step, not a fast one


def test_controller_plans_keys_only_slow_rows_after_the_first_selection():
    import numpy as np

    cfg = {"bridge_steps": 0, "reuse_budget": 2, "min_gap": 0, "boundary_token_ids": [7], "slow_attention": "keys"}
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg, max_num_seqs=2))
    p = ctl.plan_step(["a"], np.array([1]), np.array([40]), [40], torch.tensor([1]))
    assert p.modes == [StepMode.SLOW] and p.keys_only is None  # the first selection attends densely
    for ctx in (41, 42):
        p = ctl.plan_step(["a"], np.array([1]), np.array([ctx]), [40], torch.tensor([1]))
        assert p.modes == [StepMode.FAST] and p.keys_only is None
    p = ctl.plan_step(["a"], np.array([1]), np.array([43]), [40], torch.tensor([1]))
    assert p.modes == [StepMode.SLOW] and p.keys_only == [True] and p.attends_set(0)
    dense = SFIController(build_config({**cfg, "slow_attention": "dense"}, use_env=False), fake_vllm_config(cfg))
    for ctx in (40, 41, 42, 43):
        p = dense.plan_step(["a"], np.array([1]), np.array([ctx]), [40], torch.tensor([1]))
    assert p.modes == [StepMode.SLOW] and p.keys_only is None and not p.attends_set(0)


@pytest.mark.parametrize("mode", ["lossy", "lossless"])
def test_layer_interleaved_rows_keep_the_in_graph_refresh_only_where_it_applies(mode):
    """A row that asks for layer-interleaved refreshes takes the eager refresh in the lossy mode
    (half the layers per slow step); lossless mode re-selects every layer whatever the row asks, so
    such a row keeps the drafter's in-graph refresh."""
    from sfi_vllm.compact import RowGeometry

    cfg = {"bridge_steps": 0, "sinks": 4, "recent_window": 64, "selected_tokens": 128, "mode": mode,
           "boundary_token_ids": [7]}
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg, max_num_seqs=4))
    executor = executor_for(ctl)
    executor.graph_slow_ready = True
    plain = ctl.cfg
    interleaved = plain.model_copy(update={"layer_interleaved_refresh": True})
    geometry = [RowGeometry.at(plain, 2000)] * 2
    assert executor._slow_rows_fit_graph([plain, plain], geometry)
    assert executor._slow_rows_fit_graph([plain, interleaved], geometry) == (mode == "lossless")
    # ... and an engine that sets it keeps its slow steps in the graphs only in lossless mode
    engine = {**cfg, "layer_interleaved_refresh": True}
    assert build_config(engine, use_env=False).graph_slow_enabled == (mode == "lossless")
    if mode == "lossless":
        assert build_config({**engine, "slow_in_graph": True, "fused_scores_tokens": 4096}, use_env=False)
    else:
        with pytest.raises(ValueError, match="no layer_interleaved_refresh"):
            build_config({**engine, "slow_in_graph": True}, use_env=False)


def test_prompt_window_queries_join_the_first_selections_evidence():
    """sfi.experimental.prompt_window: the last queries of a prompt prefilled in two chunks are kept
    (a chunk shorter than the window extends the previous one's), and the first selection pools
    their causal attention with its own query's; then they are forgotten."""
    from sfi_vllm.attention_ref import causal_attention_probs

    cfg = {"sinks": 4, "recent_window": 32, "selected_tokens": 48, "min_gap": 0,
           "experimental": {"prompt_window": 8}}
    ctl = SFIController(build_config({"bridge_steps": 0, "boundary_token_ids": [7], **cfg}, use_env=False),
                        fake_vllm_config(cfg))
    c = ctl.cfg
    layer = SFILayer(ctl, num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    ctx = 601  # a 600-token prompt and the first decode token
    paged, cam, q, ks, vs = make_batch("flash", 16, [ctx], [1])
    prompt_q = torch.randn(600, 9, 64, generator=torch.Generator().manual_seed(5))
    for first, stop in ((590, 595), (595, 600)):  # the prompt's last two chunks, 5 tokens each
        n = stop - first
        qsl = torch.tensor([0, n], dtype=torch.int32)
        chunk = cam.replace(query_start_loc=qsl, query_start_loc_cpu=qsl)
        step = make_step(plan_for([StepMode.PREFILL], cfg=c, context=[stop]), chunk, lambda s: None)
        layer.keep_prompt_queries(step, prompt_q[first:stop], 8)
    req, kept, end = layer.prompt_queries[0]
    assert req == "r0" and end == 600 and torch.equal(kept, prompt_q[592:600])
    slow = make_step(plan_for([StepMode.SLOW], cfg=c, context=[ctx]), cam, lambda s: None)
    layer.refresh(slow, paged, q, layer_idx=0)
    assert 0 not in layer.prompt_queries  # used once
    k_all = ks[0].permute(1, 0, 2)
    ws, kk = window_start(c, ctx), selected_count(c, ctx)
    probs = torch.cat([attention_probs(q[0], k_all, 0.125), causal_attention_probs(prompt_q[592:600], 600, k_all, 0.125)],
                      dim=1)
    want = Selector(c.selector).select(probs, k_all[:, 4:ws].norm(dim=-1), 4, ws, kk)
    got = layer.buffer.get(0, 1).positions[:, 4:]
    assert torch.equal(got, want)
    alone = Selector(c.selector).select(attention_probs(q[0], k_all, 0.125), k_all[:, 4:ws].norm(dim=-1), 4, ws, kk)
    assert not torch.equal(got, alone)  # the window changed the selection
    # another request in the slot does not read what an earlier one left
    layer.prompt_queries[0] = ("r-old", prompt_q[592:600], 600)
    layer.refresh(slow, paged, q, layer_idx=0)
    assert torch.equal(layer.buffer.get(0, 1).positions[:, 4:], alone)
