"""Quest-style fast rows through the kernel path (page-score kernel ``sfi_vllm.kernels.quest_pages``,
top pages, repack, fast-step kernel) against the reference layer."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, case, device_batch, shape_id


def check_quest_layer(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                      seq_lens=(3000, 900, 5000, 1400, 150, 40), retention=0.15):
    """Quest-style fast rows through the kernel path (page-score kernel, top pages, repack,
    fast-step kernel) against the reference layer's per-row ``_quest_set``; the rows include one
    whose pages all fit the budget (they join the window) and one with no whole page."""
    from sfi_vllm.backends.common import SFILayer, make_step
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import fake_vllm_config, plan_for

    n = len(seq_lens)
    over = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("quest", retention, 3000)}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    cfg = ctl.cfg
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    paged, cam, qd = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=3)
    step = make_step(plan_for([StepMode.FAST] * n, cfg=cfg, context=list(seq_lens)), cam, lambda s: None)
    kinds = set()
    for r, c in enumerate(seq_lens):
        from sfi_vllm.compact import window_start
        w = window_start(cfg, c)
        pages = (w - cfg.sinks) // cfg.quest_page
        budget = min(pages, cfg.selected_budget(c) // cfg.quest_page)
        kinds.add("scored" if 0 < budget < pages else "all" if budget == pages and pages else "none")
    assert kinds == {"scored", "all", "none"}, kinds
    outs = []
    for layer in (ref, fast):
        out = torch.full_like(qd, float("nan"))
        layer.fast(step, paged, qd, out)
        outs.append(out.float().cpu())
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert torch.isfinite(outs[1]).all() and err < 2e-2, f"quest rows: {err}"
    return err


CASES = [
    case("cpu", torch.float32, dict(hq=6, hkv=3, d=32, seq_lens=(900, 400, 1300, 500, 60)), 1e-4,
         id=shape_id(torch.float32, 6, 3, 32)),
    *(case("cuda", dtype, dict(hq=hq, hkv=hkv, d=d), None, id=shape_id(dtype, hq, hkv, d))
      for dtype in GPU_DTYPES for hq, hkv, d in ((32, 8, 128), (9, 3, 64))),
]


@pytest.mark.parametrize("device,dtype,kw,tol", CASES)
def test_quest_layer(device, dtype, kw, tol):
    err = check_quest_layer(device, dtype, **kw)  # asserts its own bound, 2e-2
    if tol is not None:
        assert err < tol, err
