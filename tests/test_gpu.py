"""GPU checks (skipped without CUDA): the reference SFI layer on CUDA tensors, FlashAttention's
paged layout, bf16 and fp16 caches, head sizes 64 and 128, against float64 brute force."""

import pytest
import torch

from sfi_vllm.backends.common import SFILayer, make_step
from sfi_vllm.compact import selected_count, window_start
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController
from sfi_vllm.paged_kv import PagedKV
from sfi_vllm.trigger import StepMode
from test_attention_ref import brute_force
from test_sfi_layer import fake_vllm_config, make_batch, plan_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
def test_sfi_layer_on_cuda_matches_brute_force(dtype, hq, hkv, d):
    cfg = {"sinks": 4, "recent_window": 64, "selected_tokens": 48, "min_gap": 0,
           "boundary_token_ids": [7]}
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg, max_model_len=8192))
    layer = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    seq_lens, qlens = [900, 300, 2000], [1, 1, 1]
    paged_cpu, cam, q, ks, vs = make_batch("flash", 16, seq_lens, qlens, hq=hq, hkv=hkv, d=d)
    cache = paged_cpu.kv_cache.permute(0, 2, 1, 3).contiguous().to("cuda", dtype).permute(0, 2, 1, 3)
    paged = PagedKV(cache, "flash", d)
    cam.block_table_tensor = cam.block_table_tensor.cuda()
    qc = q.to("cuda", dtype)
    modes = [StepMode.FAST] * 3
    layer.refresh(make_step(plan_for([StepMode.SLOW] * 3, cfg=ctl.cfg), cam, lambda s: None), paged, qc, 0)
    out = torch.zeros_like(qc)
    layer.fast(make_step(plan_for(modes, cfg=ctl.cfg), cam, lambda s: None), paged, qc, out)
    c = build_config(cfg, use_env=False)
    for row, ctx in enumerate(seq_lens):
        entry = layer.buffer.get(row, 1)
        ws = window_start(c, ctx)
        assert entry.num_tokens == 4 + selected_count(c, ctx) and entry.window_start == ws
        keep = [torch.cat([entry.positions[h].cpu(), torch.arange(ws, ctx)]) for h in range(hkv)]
        k = ks[row].permute(1, 0, 2).to(dtype).double()
        v = vs[row].permute(1, 0, 2).to(dtype).double()
        ref = brute_force(qc[row].double().cpu(), k, v, d ** -0.5, keep)
        err = (out[row].double().cpu() - ref).norm() / ref.norm()
        assert err < 1e-2, err

# The packed GPU path (score kernel, batched Selector, repack, fast-step tables, uniform launch)
# against the reference layer: tests/kernels/test_packed_layer.py (with the other kernel tests).


def test_lagged_token_reads_on_cuda_match_the_cpu_and_do_not_wait():
    """``boundary_read = "lagged"`` with the tokens on the GPU: the asynchronous copies give the
    decisions of the CPU run, and after a step's work has finished its copy needs no wait."""
    from sfi_vllm.trigger import BoundaryTokens, LaggedTokens, SlowStepTrigger

    cfg = build_config({"reuse_budget": 20, "min_gap": 2}, use_env=False)
    bt = BoundaryTokens(frozenset({1}), frozenset({2}))
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(1, 6, (200, 3), generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        reader = LaggedTokens(SlowStepTrigger(cfg, num_slots=3, vocab_size=8, boundary=bt))
        modes = []
        for i in range(stream.shape[0]):
            toks = stream[i].to(dev)
            m, r = reader.step([0, 1, 2], [0, 0, 0], toks, [0, 1, 2], [1000 + i] * 3, [0, 0, 0], defer=True)
            modes.append((m.tolist(), r.tolist()))
            if dev == "cuda":
                torch.cuda.synchronize()  # the step's work is done before the next plan
        out[dev] = (modes, reader)
    assert out["cpu"][0] == out["cuda"][0]
    assert out["cuda"][1].reads == stream.shape[0] - 1 and out["cuda"][1].waits == 0
