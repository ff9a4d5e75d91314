"""The fused Selector kernels (``sfi_vllm.kernels.selector_scores``) against the batched torch
Selector, for the default settings and each ablation's switches.

The ``selection``-marked cases are those a change to the Selector or its settings needs."""

from __future__ import annotations

import pytest
import torch

from builders import case


def check_selector_scores(device="cuda", hkv=8, g=4, frame=6000, lo=4, seq_lens=(6000, 3100, 900, 40),
                          window=256, kmax=512, seed=5, block=1024, variants=None, launch=None):
    """The fused selector kernels against the batched torch Selector (steps 1-5 compared as scores,
    step 6 as selections) for the default settings and each ablation's switches. ``block`` sets the
    statistics passes' tile, and with it how many splits of the frame they use; ``launch``, other
    launch parameters of ``selector_scores`` (those ``benchmarks/selector_bench.py`` times)."""
    from sfi_vllm.config import SelectorConfig
    from sfi_vllm.selector import PageScores, Selector, batched_scores_static, top_k_positions
    from sfi_vllm.kernels.selector_scores import selector_scores

    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    logits = 3.0 * torch.randn(B, hkv, g, frame, generator=gen)
    # a few strong positions, clustered, as real attention has
    hot = torch.randint(0, frame, (B, hkv, 8), generator=gen)
    for b in range(B):
        for h in range(hkv):
            for p in hot[b, h].tolist():
                logits[b, h, :, max(0, p - 2):p + 3] += 8.0
    norms = 0.5 + torch.rand(B, hkv, frame, generator=gen) * 2
    for b, s in enumerate(seq_lens):
        logits[b, ..., s:] = float("-inf")
        norms[b, :, s:] = 0.0
    n = torch.tensor([max(1, s - window - lo) for s in seq_lens], dtype=torch.float32)
    k = torch.clamp(n.long() // 3, min=1, max=kmax)
    logits, norms, n, k = (t.to(device) for t in (logits, norms, n, k))
    worst = 0.0
    if variants is None:
        paper = {"page_size": 0, "use_nms": True, "follow_pages": 0}  # the paper's token-level Selector
        variants = [{}, {"use_prior": False}, {"use_nms": True}, {"use_exclusivity": False},
                    {"page_size": 8, "follow_pages": 3, "follow_penalty": 0.5},
                    # page masses in torch (no power of two); following pages without steps 4-5
                    {"page_size": 12, "use_nms": True}, {"page_size": 16, "use_exclusivity": False},
                    paper, {**paper, "use_prior": False}, {**paper, "nms_radius": 3, "alpha": 1.0},
                    {**paper, "use_nms": False, "use_exclusivity": False}]
    for over in variants:
        for rows in (1, 2):
            cfg = SelectorConfig(**over)
            ref = batched_scores_static(Selector(cfg), torch.softmax(logits, -1), norms, lo, n, rows)
            got = selector_scores(cfg, logits, norms, lo, n, rows, block=block, **(launch or {}))
            assert type(got) is type(ref), (over, type(got), type(ref))
            pairs = [(got.pages, ref.pages), (got.tokens, ref.tokens)] if isinstance(ref, PageScores) else [(got, ref)]
            for g_, r_ in pairs:
                assert g_.shape == r_.shape, (g_.shape, r_.shape)
                fin = torch.isfinite(r_)
                assert torch.equal(fin, torch.isfinite(g_)), (over, "-inf pattern")
                err = (g_[fin] - r_[fin]).abs().max().item()
                assert err < 2e-3, (over, rows, err)
                worst = max(worst, err)
            a = top_k_positions(got, lo, k, int(k.max()))
            r = top_k_positions(ref, lo, k, int(k.max()))
            for b in range(B):
                kk = int(k[b])
                same = sum(len(set(a[b, h, :kk].tolist()) & set(r[b, h, :kk].tolist())) for h in range(hkv))
                assert same / (hkv * kk) > 0.99, (over, b, same / (hkv * kk))
    return worst


def launch_id(block, launch) -> str:
    return (f"b{block}-tp{launch['target_programs']}-w{launch['num_warps']}-t{launch['tile']}"
            f"-nt{launch['nms_tile']}-ne{launch['nms_elems']}")


CPU_FRAME = dict(hkv=3, g=3, frame=700, seq_lens=(700, 400, 90, 20), window=32, kmax=64)
CPU_LAUNCH = dict(target_programs=4096, num_warps=8, tile=64, nms_tile=32, nms_elems=128)
# launch parameters other than the defaults, the extremes of those benchmarks/selector_bench.py times
# (the second: the earlier defaults)
GPU_LAUNCHES = ((2048, dict(target_programs=2048, num_warps=8, tile=256, nms_tile=256, nms_elems=2048)),
                (1024, dict(target_programs=512, num_warps=4, tile=256, nms_tile=256, nms_elems=2048)),
                (512, dict(target_programs=4096, num_warps=4, tile=256, nms_tile=512, nms_elems=4096)))
CASES = [
    case("cpu", CPU_FRAME, id="hkv3-g3-f700-k64-11variants"),
    # 64-token tiles: the statistics passes split the frame 11 ways, some splits past a row's end
    case("cpu", dict(**CPU_FRAME, block=64, variants=[{}, {"use_prior": False},
                                                      {"page_size": 0, "use_nms": True, "follow_pages": 0}]),
         id="hkv3-g3-f700-k64-b64-3variants"),
    # other launch parameters: more splits, 8 warps, small pointwise and soft-NMS tiles
    case("cpu", dict(**CPU_FRAME, block=128, variants=[{}], launch=CPU_LAUNCH),
         id="hkv3-g3-f700-k64-" + launch_id(128, CPU_LAUNCH)),
    case("cuda", {}, id="hkv8-g4-f6000-k512-11variants", selection=True),
    case("cuda", dict(hkv=3, g=3, frame=9000, seq_lens=(9000, 8100, 300, 7000)), id="hkv3-g3-f9000-k512-11variants",
         selection=True),
    case("cuda", dict(frame=131072, seq_lens=(131072, 70000), kmax=2048), id="hkv8-g4-f131072-k2048-11variants",
         selection=True),  # 32 splits
    *(case("cuda", dict(frame=40000, seq_lens=(40000, 33000), kmax=2048, block=block, variants=[{}], launch=launch),
           id="hkv8-g4-f40000-k2048-" + launch_id(block, launch))
      for block, launch in GPU_LAUNCHES),
]


@pytest.mark.parametrize("device,kw", CASES)
def test_selector_scores(device, kw):
    check_selector_scores(device, **kw)
