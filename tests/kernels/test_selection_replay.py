"""``SlowStepSelection`` (the slow step's selection, a CUDA graph per shape) against the eager
batched Selector."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, block_tables, case, paged_cache, shape_id


def check_selection_replay(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                           seq_lens=(3000, 2900, 2500), k=(300, 300, 250), seed=4):
    """SlowStepSelection (CUDA graph per shape) against the eager batched Selector, for three
    different batches of the same shape: the first runs eagerly, the second captures, the third
    replays (``capture_after=2``), and each must read its own inputs."""
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.config import SelectorConfig
    from sfi_vllm.selector import Selector, select_batched
    from sfi_vllm.kernels.slow_scores import slow_step_scores

    g = torch.Generator().manual_seed(seed)
    sel = Selector(SelectorConfig())
    graphs = SlowStepSelection(capture_after=2)
    lo = 4
    for trial in range(3):
        nb, bt = block_tables(seq_lens, page, 3, g, device)
        paged, kc, _ = paged_cache(nb, page, hkv, d, dtype, device, g)
        q = torch.randn(len(seq_lens), hq, d, generator=g).to(device, dtype)
        seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        hi = [s - 100 - 10 * trial for s in seq_lens]
        got = graphs.select(sel, q, kc, bt, seq, list(seq_lens), lo, hi, list(k), d ** -0.5).clone()
        logits, norms = slow_step_scores(q, kc, bt, seq, max(seq_lens), d ** -0.5)
        ref = select_batched(sel, torch.softmax(logits, -1), norms, lo, hi, list(k))
        for b, kk in enumerate(k):
            a, r = got[b, :, :kk], ref[b, :, :kk]
            agree = sum(len(set(a[h].tolist()) & set(r[h].tolist())) for h in range(hkv)) / (hkv * kk)
            assert agree > 0.99, (trial, b, agree)
    assert graphs.captures == (1 if device == "cuda" else 0)
    assert graphs.eager_runs == (1 if device == "cuda" else 0)
    return 0.0


CASES = [
    case("cpu", torch.float32, dict(hq=6, hkv=3, d=32, seq_lens=(300, 290, 250), k=(30, 30, 25)),
         id=shape_id(torch.float32, 6, 3, 32)),
    *(case("cuda", dtype, dict(hq=hq, hkv=hkv, d=d), id=shape_id(dtype, hq, hkv, d))
      for dtype in GPU_DTYPES for hq, hkv, d in GPU_SHAPES),
]


@pytest.mark.parametrize("device,dtype,kw", CASES)
def test_selection_replay(device, dtype, kw):
    check_selection_replay(device, dtype, **kw)
