"""The page top-K kernel (``sfi_vllm.kernels.top_k_pages``) against ``sfi_vllm.selector.top_k_pages``."""

from __future__ import annotations

import pytest
import torch

from builders import case


def page_scores(rows, hkv, width, page, n, gen, tied=False):
    """Token ``log s (rows, hkv, width)`` (``-inf`` from row ``b``'s ``n[b]`` candidates on) and page
    scores over them (each page's mass plus noise, ``-inf`` for pages past the candidates), as the
    fused Selector hands them to top-K. ``tied``: few distinct values in both, so that many pages and
    many tokens of a page tie."""
    from sfi_vllm.selector import PageScores, page_mass

    tokens = torch.randn(rows, hkv, width, generator=gen) * 3
    if tied:
        tokens = tokens.round().clamp(-2, 2)
    tokens = torch.where(torch.arange(width)[None, None, :] < n[:, None, None], tokens, float("-inf"))
    pages = page_mass(tokens, page) + torch.randn(rows, hkv, -(-width // page), generator=gen)
    if tied:
        pages = pages.round().clamp(-1, 3)
    pages = torch.where(page_mass(tokens, page) > float("-inf"), pages, float("-inf"))
    return PageScores(pages.contiguous(), tokens.contiguous(), page)


def check_top_k_pages(device="cuda", hkv=8, width=35000, page=16, lo=4, kmax=2048, block=1024, seed=3,
                      n=(35000, 20000, 9001, 2050, 40), k=None):
    """The kernel against the reference on scores without ties between pages (random page scores,
    budgets below ``kmax``, rows whose candidates end inside a page, a row with fewer candidates
    than its budget), and on scores with many ties against the reference's ``stable`` rule (the
    lower page first), which is the kernel's."""
    from sfi_vllm.selector import PageScores, top_k_pages
    from sfi_vllm.kernels.top_k_pages import top_k_pages as top_k_pages_kernel

    gen = torch.Generator().manual_seed(seed)
    rows = len(n)
    n_t = torch.tensor(n)
    k = torch.tensor(k if k is not None else [kmax, kmax // 2 + 5, 1, kmax - 3, 7][:rows])
    for tied in (False, True):
        sc = page_scores(rows, hkv, width, page, n_t, gen, tied=tied)
        want = top_k_pages(sc, lo, k, kmax, stable=tied)
        dev = PageScores(sc.pages.to(device), sc.tokens.to(device), page)
        got = top_k_pages_kernel(dev, lo, k.to(device), kmax, block=block)
        assert torch.equal(got.cpu(), want), f"page top-K, ties: {tied}"
    return 0.0


CASES = [
    case("cpu", dict(hkv=2, width=700, kmax=64, block=16, n=(700, 500, 333, 41, 3)), id="hkv2-w700-k64-b16"),
    case("cpu", dict(hkv=3, width=513, page=8, kmax=100, block=32, n=(513, 400, 20), k=(100, 37, 100)),
         id="hkv3-w513-p8-k100"),
    case("cpu", dict(hkv=2, width=20, kmax=5, block=16, n=(20, 3), k=(5, 5)), id="hkv2-w20-k5-two-pages"),
    case("cpu", dict(hkv=2, width=300, page=32, kmax=70, block=16, n=(300, 290), k=(70, 1)), id="hkv2-w300-p32-k70"),
    # a tile above the smallest in the interpreter (its smallest is 32: 128 here, for 100 pages)
    case("cpu", dict(hkv=2, width=200, page=2, kmax=600, block=64, n=(200, 150), k=(600, 37)),
         id="hkv2-w200-p2-k600-larger-tile"),
    case("cpu", dict(hkv=2, width=96, page=4, kmax=64, block=16, n=(96, 0, 50), k=(0, 20, 64)),
         id="hkv2-w96-p4-budget0-no-candidates"),
    case("cuda", {}, id="hkv8-w35000-k2048"),
    case("cuda", dict(width=131072, n=(131072, 130000, 70001, 4096, 2100), block=2048), id="hkv8-w131072-k2048"),
    case("cuda", dict(width=20000, kmax=8192, n=(20000, 9000, 8192, 100, 8191)), id="hkv8-w20000-k8192"),
]


@pytest.mark.parametrize("device,kw", CASES)
def test_top_k_pages(device, kw):
    check_top_k_pages(device, **kw)


def test_page_sizes_the_kernel_does_not_take_get_torchs_top_k():
    """A request may set any page size from 2 to 256; the kernel takes powers of two up to 32 and
    the others go to torch's top-K (a slow step must not fail on the kernel's assertion)."""
    from sfi_vllm.backends.selection import top_k_function
    from sfi_vllm.kernels.top_k import top_k_positions as token_kernel
    from sfi_vllm.kernels.top_k_pages import supports, top_k_pages as page_kernel
    from sfi_vllm.selector import top_k_positions

    assert [p for p in range(2, 257) if supports(p)] == [2, 4, 8, 16, 32]
    for kind in ("auto", "triton"):
        assert top_k_function(kind, 16) is page_kernel
        for page in (3, 24, 64, 256):
            assert top_k_function(kind, page) is top_k_positions
    assert top_k_function("torch", 16) is top_k_positions
    assert top_k_function("auto", 0) is top_k_positions and top_k_function("triton", 1) is token_kernel


def test_integers_that_follow_the_batch_are_not_specialised():
    """Triton compiles a variant per specialisation of an integer argument (equal to 1, a multiple
    of 16): the output's strides follow ``kmax`` (a budget of 2,048 or 2,040, a fraction of the
    context), the frame follows the batch. Only ``lo`` (the sinks, fixed per engine) may be
    specialised. Read from the compiled kernel's parameters, in a process without the interpreter."""
    import os
    import subprocess
    import sys

    code = ("import sfi_vllm.kernels.top_k_pages as m; "
            "print(' '.join(p.name for p in m._top_k_pages.params "
            "if not p.is_constexpr and p.name.islower() and not p.do_not_specialize))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lo"]
