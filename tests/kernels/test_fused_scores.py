"""The fast-step kernel's fused slow-step scores (``fast_decode_attention(scores=...)``) against
the gathered keys' logits and norms."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, block_tables, case, paged_cache, shape_id


def check_fused_scores(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                       seq_lens=(3000, 900, 2100, 700, 0), splits=(1, 3), seed=5, key_block_n=None,
                       row_splits=None):
    """The fast-step kernel's fused slow-step scores: rows 1 and 2 are dense and scored (one
    group of two rows, frame width past both contexts, written as layer 1 of 2), row 0 has a
    compact set and is scored too (a keys-only slow row: a group of its own after the first),
    row 3 is dense and not scored, row 4 is padding. Their logits and key norms against the
    gathered keys; nothing written outside the three frames; the attention output the same as
    without scores (row 0's through its compact set and window). ``key_block_n``: the keys-only
    row's score tile (None: the kernel's default). ``row_splits``: each row's own split count
    (balanced splits)."""
    from sfi_vllm.kernels.fast_decode import ScoreFrames, fast_decode_attention, make_workspace

    g = torch.Generator().manual_seed(seed)
    B, G = len(seq_lens), hq // hkv
    nb, bt = block_tables([max(s, 1) for s in seq_lens], page, 5, g, device)
    paged, kc, vc = paged_cache(nb, page, hkv, d, dtype, device, g)
    ck = torch.randn(2, hkv, 64, d, generator=g).to(device, dtype)
    cv = torch.randn(2, hkv, 64, d, generator=g).to(device, dtype)
    nc = torch.tensor([50, 0], dtype=torch.int32, device=device)
    ws = torch.tensor([seq_lens[0] - 100, 0], dtype=torch.int32, device=device)
    row_slot = torch.tensor([0, -1, -1, -1, -1], dtype=torch.int32, device=device)
    zeros = torch.zeros(B, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    width, layers, rows = max(seq_lens[1:3]) + 37, 2, 2
    width0 = seq_lens[0] + 11  # row 0's group: one row
    lead = 3  # tokens of frame space before the group's (another group's, say)
    base0 = lead + layers * rows * width
    base = torch.tensor([base0, lead, lead + width, -1, -1], dtype=torch.int32, device=device)
    stride = torch.tensor([width0] + [rows * width] * (B - 1), dtype=torch.int32, device=device)
    wid = torch.tensor([width0] + [width] * (B - 1), dtype=torch.int32, device=device)
    tokens = base0 + layers * width0 + 5
    per_row = None if row_splits is None else torch.tensor(row_splits, dtype=torch.int32, device=device)
    worst = 0.0
    for ns in splits:
        plain = torch.full_like(q, float("nan"))
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, zeros, sl, nc, ws, scale, ns, out=plain,
                              workspace=make_workspace(B, hq, d, ns, device), row_splits=per_row)
        logits = torch.full((tokens * hq,), float("nan"), device=device)
        norms = torch.full((tokens * hkv,), float("nan"), device=device)
        out = torch.full_like(q, float("nan"))
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, zeros, sl, nc, ws, scale, ns, out=out,
                              workspace=make_workspace(B, hq, d, ns, device),
                              scores=ScoreFrames(base, stride, wid, logits, norms, 1), key_block_n=key_block_n,
                              row_splits=per_row)
        assert torch.equal(out, plain), "the scores changed the attention output"
        lg = logits[(lead + rows * width) * hq:(lead + 2 * rows * width) * hq].view(rows, hkv, G, width)
        nm = norms[(lead + rows * width) * hkv:(lead + 2 * rows * width) * hkv].view(rows, hkv, width)
        at0 = base0 + width0  # row 0's frame of layer 1
        lg0 = logits[at0 * hq:(at0 + width0) * hq].view(1, hkv, G, width0)
        nm0 = norms[at0 * hkv:(at0 + width0) * hkv].view(1, hkv, width0)
        for b, lgb, nmb in ((1, lg[0], nm[0]), (2, lg[1], nm[1]), (0, lg0[0], nm0[0])):
            n = seq_lens[b]
            keys, _ = paged.gather_range(bt[b], 0, n, want_values=False)
            ref = torch.einsum("hgd,hnd->hgn", q[b].float().view(hkv, G, d), keys.float()) * scale
            assert torch.all(lgb[..., n:] == float("-inf")) and torch.all(nmb[:, n:] == 0)
            worst = max(worst, (lgb[..., :n].cpu() - ref.cpu()).abs().max().item())
            assert torch.allclose(nmb[:, :n], keys.float().norm(dim=-1), rtol=1e-3, atol=1e-3)
        written = torch.zeros(tokens, dtype=torch.bool)
        written[lead + rows * width:lead + 2 * rows * width] = True
        written[at0:at0 + width0] = True
        assert torch.isnan(logits.view(tokens, hq)[~written]).all(), "logits written outside the frames"
        assert torch.isnan(norms.view(tokens, hkv)[~written]).all(), "norms written outside the frames"
    return worst


CASES = [
    *(case("cpu", dtype, dict(hq=4, hkv=2, d=32, seq_lens=(200, 90, 130, 70, 0)), tol, id=shape_id(dtype, 4, 2, 32))
      for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2))),
    # balanced splits: the keys-only row 0 on 3 of the grid's 4 splits (its frame's tail written by
    # its last), dense row 2 on all 4, row 1 on 1
    case("cpu", torch.float32, dict(hq=4, hkv=2, d=32, seq_lens=(200, 90, 130, 70, 0), splits=(4,),
                                    row_splits=(3, 1, 4, 2, 1)), 1e-4, id=shape_id(torch.float32, 4, 2, 32) + "-row-splits"),
    *(case("cuda", dtype, dict(hq=hq, hkv=hkv, d=d), 5e-2, id=shape_id(dtype, hq, hkv, d))
      for dtype in GPU_DTYPES for hq, hkv, d in GPU_SHAPES),
    case("cuda", torch.bfloat16, dict(hq=32, hkv=8, d=128, splits=(8,), row_splits=(5, 1, 8, 2, 1)), 5e-2,
         id=shape_id(torch.bfloat16, 32, 8, 128) + "-row-splits"),
]


@pytest.mark.parametrize("key_block_n", [32, 128])
@pytest.mark.parametrize("device,dtype,kw,tol", CASES)
def test_fused_scores(device, dtype, kw, tol, key_block_n):
    """Each tile of the keys-only pass: one the window's size, and one of four window tiles
    (with its norms from four slices); row 0's keys end inside a tile of either size."""
    err = check_fused_scores(device, dtype, key_block_n=key_block_n, **kw)
    assert err < tol, (dtype, err)
