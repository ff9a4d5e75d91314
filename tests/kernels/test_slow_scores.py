"""The slow-step score kernel (``sfi_vllm.kernels.slow_scores``) against ``attention_probs``."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, block_tables, case, paged_cache, shape_id


def check_slow_scores(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                      seq_lens=(3000, 77, 1290), seed=2, **launch):
    """Logits -> probabilities and key norms against ``attention_probs`` on the gathered keys."""
    from sfi_vllm.attention_ref import attention_probs
    from sfi_vllm.kernels.slow_scores import slow_step_scores

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables(seq_lens, page, 3, g, device)
    paged, kc, _ = paged_cache(nb, page, hkv, d, dtype, device, g)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    width = max(seq_lens) + 5
    logits, norms = slow_step_scores(q, kc, bt, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                     width, scale, **launch)
    probs = torch.softmax(logits, dim=-1)
    worst = 0.0
    for b, n in enumerate(seq_lens):
        keys, _ = paged.gather_range(bt[b], 0, n, want_values=False)
        ref = attention_probs(q[b], keys, scale)
        assert torch.all(probs[b, ..., n:] == 0) and torch.all(norms[b, :, n:] == 0)
        worst = max(worst, (probs[b, ..., :n] - ref).abs().max().item())
        assert torch.allclose(norms[b, :, :n], keys.float().norm(dim=-1), rtol=1e-3, atol=1e-3)
    return worst


CASES = [
    *(case("cpu", dtype, dict(hq=4, hkv=2, d=32, seq_lens=(150, 33)), tol, id=shape_id(dtype, 4, 2, 32))
      for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3))),
    # launch parameters: other tiles
    *(case("cpu", torch.float32, dict(hq=12, hkv=4, d=32, seq_lens=(150, 33), block_n=bn), 1e-5,
           id=f"fp32-h12-kv4-d32-block{bn}") for bn in (32, 128)),
    *(case("cuda", dtype, dict(hq=hq, hkv=hkv, d=d), 2e-3, id=shape_id(dtype, hq, hkv, d))
      for dtype in GPU_DTYPES for hq, hkv, d in GPU_SHAPES),
    *(case("cuda", torch.bfloat16, dict(block_n=bn, num_warps=w), 2e-3, id=f"bf16-block{bn}-warps{w}")
      for bn, w in ((128, 4), (128, 8), (32, 4))),
]


@pytest.mark.parametrize("device,dtype,kw,tol", CASES)
def test_slow_scores(device, dtype, kw, tol):
    err = check_slow_scores(device, dtype, **kw)
    assert err < tol, (dtype, err)
