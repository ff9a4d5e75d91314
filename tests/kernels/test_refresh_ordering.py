"""CUDA only: the slow step's refresh on the second stream, ordered by events, against the same
refresh inline."""

from __future__ import annotations

import pytest
import torch

from builders import device_batch

pytestmark = pytest.mark.gpu


def check_refresh_ordering(dtype=torch.bfloat16, hq=32, hkv=8, d=128, seq_lens=(12000, 5000, 9000),
                           retention=0.1, sleep_cycles=200_000_000, refresh="per_layer"):
    """CUDA only: the slow step's refresh runs on the second stream, ordered by events. The refresh
    stream is held up (a sleep kernel) while a second slow step's refresh is enqueued; a fast step
    issued before the join must read the previous (published) sets exactly, one issued after the
    join the new ones. Fails if publication is not ordered after the repack on the refresh stream
    (the poisoned spare sets would be read) or if the join does not wait (the old sets would be)."""
    from sfi_vllm.backends.common import attach_fast_tables, make_step
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import fake_vllm_config, plan_for

    device = "cuda"
    n = len(seq_lens)
    over = {"boundary_token_ids": [7], "min_gap": 0, "slow_refresh": refresh,
            **policy_overrides("sfi", retention, max(seq_lens))}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
    assert ctl.cfg.side_stream
    packed = PackedCompactBuffer(4, hkv, ctl.cfg.compact_capacity(max(seq_lens)), d, dtype, device, double_buffer=True)
    fast = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    paged, cam, q1 = device_batch(seq_lens, device, dtype, hq, hkv, d)
    ctx = list(seq_lens)
    q2 = torch.randn(q1.shape, generator=torch.Generator().manual_seed(11)).to(device, dtype)
    slow = make_step(plan_for([StepMode.SLOW] * n, cfg=ctl.cfg, context=ctx), cam, lambda s: None)
    step = make_step(plan_for([StepMode.FAST] * n, cfg=ctl.cfg, context=ctx), cam, lambda s: None)
    attach_fast_tables(step, cam, ctl)

    def read() -> torch.Tensor:
        out = torch.full_like(q1, float("nan"))
        fast.fast(step, paged, q1, out)
        return out

    fast.refresh(slow, paged, q1, 0)
    ctl.end_step()
    ctl.executor.join_refresh()
    old = read()
    torch.cuda.synchronize()
    assert torch.isfinite(old).all()
    # poison every spare set, hold the refresh stream up, enqueue the second refresh
    for slot in range(n):
        packed.keys[packed.target(slot)] = float("nan")
        packed.values[packed.target(slot)] = float("nan")
    side = ctl.executor.refresh_stream(torch.device(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(sleep_cycles)
    fast.refresh(slow, paged, q2, 0)
    ctl.end_step()
    during = read()  # no join: must see the published (first) sets
    ctl.executor.join_refresh()
    after = read()
    torch.cuda.synchronize()
    assert side.query()  # the refresh stream has drained
    assert torch.equal(during, old), "a fast step before the join read something other than the published sets"
    # the reference for the second selection: the same refresh inline (no second stream)
    ref = PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5,
                   packed=PackedCompactBuffer(4, hkv, packed.capacity, d, dtype, device, double_buffer=True))
    q_rows = q2[torch.tensor([slow.row_token[r] for r in range(n)], device=device)]
    ref._refresh_packed(slow, paged, q_rows, cam.block_table_tensor[:n].to(torch.int32), list(range(n)))
    out_ref = torch.full_like(q1, float("nan"))
    ref.fast(step, paged, q1, out_ref)
    torch.cuda.synchronize()
    assert torch.isfinite(after).all(), "a fast step after the join read a poisoned (unwritten) set"
    assert torch.equal(after, out_ref), "after the join the fast step must read the new sets"
    assert not torch.equal(after, old), "test inconclusive: both selections gave the same output"
    return 0.0


@pytest.mark.parametrize("refresh", [pytest.param(r, id=f"cuda-{r}-hq32-hkv8-d128-bf16")
                                     for r in ("per_layer", "per_step")])
def test_refresh_ordering(refresh):
    check_refresh_ordering(refresh=refresh)
