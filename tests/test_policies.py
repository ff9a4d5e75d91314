"""Baseline policies in the SFI layer: dense, streaming, snapkv, quest, and SFI ablations."""

import numpy as np
import pytest
import torch

from sfi_vllm.backends.common import SFILayer, make_step
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController
from sfi_vllm.tools.policies import POLICIES, policy_overrides, working_set
from sfi_vllm.trigger import StepMode
from test_attention_ref import brute_force
from test_sfi_layer import fake_vllm_config, make_batch, plan_for


def controller(sfi=None, n=4):
    sfi = {"boundary_token_ids": [7], "min_gap": 0, "bridge_steps": 0, **(sfi or {})}
    return SFIController(build_config(sfi, use_env=False), fake_vllm_config(sfi, max_num_seqs=n))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_validates_at_its_budget(policy):
    ctl = controller()
    cfg = ctl.request_config({"sfi": policy_overrides(policy, 0.1, 4096)})
    assert cfg.policy == policy.split("-")[0] if policy.startswith("sfi") else cfg.policy == policy
    if policy not in ("dense",):
        s, w, k = cfg.sinks, cfg.recent_window, cfg.selected_budget(4096)
        assert s + w + k == round(0.1 * 4096)


def test_working_set_sizes():
    assert working_set(0.1, 2048) == (4, 48, 153)
    assert working_set(0.2, 8192) == (4, 256, 1378)


def test_per_request_policies_drive_the_trigger():
    ctl = controller({"reuse_budget": 3, "reuse_stagger": False}, n=5)
    reqs = ["d", "s", "k", "q", "f"]
    over = [{"sfi": policy_overrides(p, 0.2, 1000)} for p in ("dense", "streaming", "snapkv", "quest", "sfi")]
    modes = []
    for step in range(6):
        p = ctl.plan_step(reqs, np.ones(5, int), np.full(5, 1000 + step), [900] * 5,
                          torch.full((5,), 3), over)
        modes.append(p.modes)
    modes = np.array(modes)
    assert (modes[:, 0] == StepMode.DENSE).all()
    assert modes[0, 1] == StepMode.SLOW and (modes[1:, 1] == StepMode.FAST).all()  # selects nothing, once
    assert modes[0, 2] == StepMode.SLOW and (modes[1:, 2] == StepMode.FAST).all()  # never refreshes
    assert (modes[:, 3] == StepMode.FAST).all()  # quest selects at every step, no slow step
    assert list(modes[:, 4]) == [StepMode.SLOW, StepMode.FAST, StepMode.FAST, StepMode.FAST, StepMode.SLOW, StepMode.FAST]
    assert ctl.stats.get("q").policy == "quest"


def test_bad_request_config_runs_dense_and_is_recorded():
    ctl = controller()
    p = ctl.plan_step(["x"], np.ones(1, int), np.array([500]), [400], torch.tensor([3]), [{"sfi": {"sinks": -1}}])
    assert p.modes == [StepMode.DENSE]
    assert "extra_args.sfi.sinks" in ctl.stats.get("x").config_error


def _layer_out(policy_over, seq_len=900, seed=0):
    ctl = controller()
    cfg = ctl.request_config({"sfi": policy_over})
    layer = SFILayer(ctl, 9, 3, 64, 0.125)
    paged, cam, q, ks, vs = make_batch("flash", 16, [seq_len], [1], seed=seed)
    layer.refresh(make_step(plan_for([StepMode.SLOW], cfg=cfg), cam, lambda s: None), paged, q, 0)
    out = torch.zeros_like(q)
    layer.fast(make_step(plan_for([StepMode.FAST], cfg=cfg), cam, lambda s: None), paged, q, out)
    return cfg, layer, q, ks[0].permute(1, 0, 2), vs[0].permute(1, 0, 2), out


def test_streaming_attends_sinks_and_last_window():
    cfg, _, q, k, v, out = _layer_out(policy_overrides("streaming", 0.2, 900))
    ws = ((900 - cfg.recent_window) // 16) * 16
    keep = [torch.cat([torch.arange(4), torch.arange(ws, 900)])] * 3
    assert torch.allclose(out[0].double(), brute_force(q[0], k, v, 0.125, keep), atol=1e-5)


def test_quest_attends_the_pages_with_the_highest_bound():
    over = policy_overrides("quest", 0.2, 900)
    cfg, _, q, k, v, out = _layer_out(over)
    ws = ((900 - cfg.recent_window) // 16) * 16
    n_pages = (ws - 4) // 16
    lo = ws - n_pages * 16
    pages = cfg.selected_budget(900) // 16
    keep = []
    for h in range(3):
        best = []
        for pg in range(n_pages):
            kk = k[h, lo + pg * 16: lo + (pg + 1) * 16]
            bound = max(float(torch.maximum(q[0, g] * kk.min(0).values, q[0, g] * kk.max(0).values).sum())
                        for g in range(h * 3, h * 3 + 3))
            best.append((bound, pg))
        chosen = sorted(pg for _, pg in sorted(best, reverse=True)[:pages])
        tok = torch.cat([torch.arange(lo + pg * 16, lo + (pg + 1) * 16) for pg in chosen])
        keep.append(torch.cat([torch.arange(4), tok, torch.arange(ws, 900)]))
    assert torch.allclose(out[0].double(), brute_force(q[0], k, v, 0.125, keep), atol=1e-5)


def test_snapkv_selection_differs_from_sfi():
    _, snap, *_ = _layer_out(policy_overrides("snapkv", 0.1, 900))
    _, sfi, *_ = _layer_out(policy_overrides("sfi", 0.1, 900))
    a, b = snap.buffer.get(0, 1).positions, sfi.buffer.get(0, 1).positions
    assert a.shape == b.shape and not torch.equal(a, b)


def test_request_cannot_change_engine_wide_settings_or_outgrow_the_buffers():
    from types import SimpleNamespace

    def ctl_with_len(sfi, max_model_len=8192):
        sfi = {"boundary_token_ids": [7], "min_gap": 0, **sfi}
        vc = fake_vllm_config(sfi, max_num_seqs=4)
        vc.model_config = SimpleNamespace(**vc.model_config.__dict__, max_model_len=max_model_len)
        return SFIController(build_config(sfi, use_env=False), vc)

    ctl = ctl_with_len({"selected_tokens": 1024})
    for i, (bad, needle) in enumerate((({"side_stream": False}, "sfi.side_stream is an engine-wide setting"),
                        ({"kernels": "torch"}, "sfi.kernels is an engine-wide setting"),
                        ({"boundary_token_ids": [1, 2]}, "sfi.boundary_token_ids is an engine-wide"),
                        ({"selected_tokens": 1025}, "more than the engine's compact buffers hold (1028"))):
        p = ctl.plan_step([f"r{i}"], np.ones(1, int), np.array([500]), [400], torch.tensor([3]), [{"sfi": bad}])
        assert p.modes == [StepMode.DENSE], bad  # run densely, recorded
        assert needle in ctl.stats.get(f"r{i}").config_error, ctl.stats.get(f"r{i}").config_error
    # the same value as the engine's, a smaller K, or a fraction that stays inside: accepted
    for ok in ({"side_stream": True}, {"selected_tokens": 512}, {"selected_fraction": 0.1, "selected_cap": 1024}):
        assert ctl.request_config({"sfi": ok}).policy == "sfi"
    # the refusal names the setting that outgrows the buffers, as the request wrote it
    from sfi_vllm.request_config import SFIRequestError
    for args, param in (({"sfi": {"policy": "snapkv", "selected_tokens": 1025}}, "extra_args.sfi.selected_tokens"),
                        ({"sfi_policy": "snapkv", "sfi_sinks": 10}, "vllm_xargs.sfi_sinks"),
                        ({"sfi_selected_fraction": 0.5, "sfi_selected_cap": 4096}, "vllm_xargs.sfi_selected_fraction"),
                        ({"sfi_sinks": 3, "sfi_selected_tokens": 1100}, "vllm_xargs.sfi_selected_tokens"),
                        # the preset's K (2048) is at fault, not the sinks the request also gave
                        ({"sfi": {"preset": "balanced", "sinks": 4}}, "extra_args.sfi.preset"),
                        # of the budget's two forms, the one in force
                        ({"sfi": {"selected_fraction": 0.5, "selected_tokens": None}},
                         "extra_args.sfi.selected_fraction")):
        with pytest.raises(SFIRequestError, match="compact buffers hold") as e:
            ctl.request_config(args)
        assert e.value.param == param, (args, e.value.param)
    # a boundary trigger the engine has no enders for
    ctl = ctl_with_len({"boundary_trigger": False, "boundary_token_ids": None})
    with pytest.raises(Exception, match="needs sentence-ender token ids"):
        ctl.request_config({"sfi": {"boundary_trigger": True}})
