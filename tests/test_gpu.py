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
    ctl = SFIController(build_config(cfg, use_env=False), fake_vllm_config(cfg))
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


@pytest.mark.parametrize("policy", ["sfi", "streaming", "snapkv"])
def test_packed_triton_path_matches_reference_layer(policy):
    """The GPU fast path (preallocated compact buffers, Triton repack + fast-step kernels) against
    the reference layer, on a batch of fast rows."""
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.policies import policy_overrides

    hq, hkv, d = 32, 8, 128
    seq_lens = [3000, 900, 5000, 1400]
    cfg_over = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides(policy, 0.15, 3000)}
    ctl = SFIController(build_config(cfg_over, use_env=False), fake_vllm_config(cfg_over))
    cfg = ctl.cfg
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, torch.bfloat16, "cuda")
    fast = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    paged_cpu, cam, q, _, _ = make_batch("flash", 16, seq_lens, [1] * 4, hq=hq, hkv=hkv, d=d)
    cache = paged_cpu.kv_cache.permute(0, 2, 1, 3).contiguous().to("cuda", torch.bfloat16).permute(0, 2, 1, 3)
    paged = PagedKV(cache, "flash", d)
    cam.block_table_tensor = cam.block_table_tensor.cuda()
    qc = q.to("cuda", torch.bfloat16)
    slow = make_step(plan_for([StepMode.SLOW] * 4, cfg=cfg), cam, lambda s: None)
    step = make_step(plan_for([StepMode.FAST] * 4, cfg=cfg), cam, lambda s: None)
    outs = []
    for layer in (ref, fast):
        layer.refresh(slow, paged, qc, 0)
        out = torch.full_like(qc, float("nan"))
        layer.fast(step, paged, qc, out)
        outs.append(out.float())
    for row in range(4):
        entry = ref.buffer.get(row, 1)
        n = entry.num_tokens
        assert packed.length[row] == n and packed.window_start[row] == entry.window_start
        assert torch.equal(packed.keys[row, :, :n], entry.keys.to(torch.bfloat16))
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 1e-2, err
