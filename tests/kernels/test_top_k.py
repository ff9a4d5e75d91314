"""The top-K kernel (``sfi_vllm.kernels.top_k``) against ``sfi_vllm.selector.top_k_positions``."""

from __future__ import annotations

import pytest
import torch

from builders import case


def check_top_k(device="cuda", rows=5, hkv=8, width=35000, lo=4, kmax=2048, block=1024, seed=6):
    """The top-K kernel against :func:`sfi_vllm.selector.top_k_positions` on scores without ties
    (negative and positive values, rows with ``-inf`` past their candidates, budgets below
    ``kmax``), and on scores with many ties against the kernel's documented rule (the lower
    positions win ties), written out with a stable sort."""
    from sfi_vllm.selector import top_k_positions
    from sfi_vllm.kernels.top_k import top_k_positions as top_k_kernel

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, hkv, width, generator=g) * torch.logspace(-3, 2, rows)[:, None, None]
    for b in range(rows):
        scores[b, :, width - 37 * (b + 1) * (b + 1):] = float("-inf")
    k = torch.tensor([kmax, kmax // 2, 1, kmax - 3, 7][:rows])
    scores, k = scores.to(device), k.to(device)
    got = top_k_kernel(scores, lo, k, kmax, block=block)
    assert torch.equal(got, top_k_positions(scores, lo, k, kmax)), "top-K without ties"
    tied = (scores * 2).round().clamp(-3, 3)  # seven distinct values (and -inf)
    got = top_k_kernel(tied, lo, k, kmax, block=block)
    order = torch.sort(tied.cpu(), dim=-1, descending=True, stable=True).indices[..., :kmax]
    keep = torch.arange(kmax)[None, None, :] < k.cpu()[:, None, None]
    want = torch.sort(torch.where(keep, order, width), dim=-1).values + lo
    assert torch.equal(got.cpu(), want), "top-K with ties: the lower positions win"
    return 0.0


CASES = [
    case("cpu", dict(rows=5, hkv=2, width=700, kmax=64, block=128), id="rows5-hkv2-w700-k64-b128"),
    case("cuda", {}, id="rows5-hkv8-w35000-k2048-b1024"),
    case("cuda", dict(rows=4, hkv=8, width=131072, block=2048), id="rows4-hkv8-w131072-k2048-b2048"),
]


@pytest.mark.parametrize("device,kw", CASES)
def test_top_k(device, kw):
    check_top_k(device, **kw)
