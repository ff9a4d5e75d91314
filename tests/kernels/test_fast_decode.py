"""The fast-step kernel (``sfi_vllm.kernels.fast_decode``) against ``fast_step_attention``."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, block_tables, case, paged_cache, shape_id
from sfi_vllm.attention_ref import fast_step_attention


def check_fast_decode(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                      seq_lens=(3000, 900, 5000, 257, 700, 0), compact=(300, 70, 1000, 4, None, None),
                      window=(256, 300, 270, 200, None, None), min_ws=(0, 0, 4900, 0, 0, 0),
                      splits=(1, 3, 8), seed=0, wide=None, row_splits=None):
    """Rows with a compact set, a row whose window slides past its refresh point (``min_ws``), a
    dense row (no slot: ``compact`` None) and an empty padding row (``seq_len`` 0). ``wide``:
    ``(wide_block_n, wide_from)`` of the launch. ``row_splits``: each row's own split count
    (balanced splits), the workspace then filled with NaN first: an idle program's partial output
    must not reach the merge."""
    from sfi_vllm.kernels.fast_decode import fast_decode_attention, make_workspace

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables([max(s, 1) for s in seq_lens], page, 5, g, device)
    paged, kc, vc = paged_cache(nb, page, hkv, d, dtype, device, g)
    slot_of_row = [5, 0, 2, 7, -1, -1][:B]
    cap = max(c for c in compact if c is not None) + 3
    ck = torch.randn(8, hkv, cap, d, generator=g).to(device, dtype)
    cv = torch.randn(8, hkv, cap, d, generator=g).to(device, dtype)
    nc_by_slot = torch.zeros(8, dtype=torch.int32)
    ws_by_slot = torch.zeros(8, dtype=torch.int32)
    for b, s in enumerate(slot_of_row):
        if s >= 0:
            nc_by_slot[s] = compact[b]
            ws_by_slot[s] = seq_lens[b] - window[b]
    row_slot = torch.tensor(slot_of_row, dtype=torch.int32, device=device)
    row_min_ws = torch.tensor(min_ws, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    refs = []
    for b in range(B):
        s = slot_of_row[b]
        if seq_lens[b] == 0:
            refs.append(torch.zeros(hq, d))
            continue
        if s < 0:
            n, ws = 0, 0
        else:
            n, ws = int(nc_by_slot[s]), max(int(ws_by_slot[s]), min_ws[b])
        wk, wv = paged.gather_range(bt[b], ws, seq_lens[b])
        refs.append(fast_step_attention(q[b], ck[max(s, 0), :, :n], cv[max(s, 0), :, :n], wk, wv, scale).cpu())
    ref = torch.stack(refs)
    worst = 0.0
    for ns in splits:
        out = torch.full_like(q, float("nan"))
        stage = torch.full((B + 2, hq, d), float("nan"), dtype=dtype, device=device) if ns == splits[-1] else None
        work = make_workspace(B, hq, d, ns, device)
        per_row = None
        if row_splits is not None:
            # partial outputs and log-sum-exps: an idle split must write its empty LSE (the merge
            # reads every split's), and its partial output is never read
            work[0].fill_(float("nan"))
            work[1].fill_(float("nan"))
            per_row = torch.tensor(row_splits, dtype=torch.int32, device=device)
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, row_min_ws, sl,
                              nc_by_slot.to(device), ws_by_slot.to(device), scale, ns, out=out,
                              workspace=work, stage=stage, row_splits=per_row,
                              **(dict(wide_block_n=wide[0], wide_from=wide[1]) if wide else {}))
        assert not torch.isnan(out).any(), f"unwritten output (splits={ns})"
        if stage is not None:  # query staging: every row's q, nothing past the batch
            assert torch.equal(stage[:B], q) and torch.isnan(stage[B:].float()).all()
        err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
    return worst


# the interpreter's rows: the same kinds as the GPU's default ones, at small sizes; 17 splits
# leave most rows' later splits without keys, as a GPU's uniform launches do (the layer tests'
# interpreter cases run uniform launches of a few splits: tests/kernels/conftest.py)
CPU_ROWS = dict(page=16, seq_lens=(300, 90, 130, 70, 45, 0), compact=(40, 3, 65, 2, None, None),
                window=(70, 60, 50, 20, None, None), min_ws=(0, 0, 100, 0, 0, 0), splits=(1, 2, 17))
CASES = [
    *(case("cpu", dtype, dict(hq=4, hkv=2, d=32, **CPU_ROWS), tol, id=shape_id(dtype, 4, 2, 32))
      for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 5e-3))),
    # wide tiles for the dense rows from 40 keys on: a dense row of 200 keys takes them (tiles
    # across the split boundaries of 2 and 3 splits), the padding row does not
    case("cpu", torch.float32, dict(hq=4, hkv=2, d=32, **{**CPU_ROWS, "seq_lens": (300, 90, 130, 70, 200, 0),
                                                          "splits": (1, 2, 3)}, wide=(64, 40)), 1e-5,
         id=shape_id(torch.float32, 4, 2, 32) + "-wide"),
    # balanced splits: per-row counts of 1, of more than the grid's (capped), 0 (taken as 1), and
    # the dense row on most of the grid; with wide tiles for the dense row too
    case("cpu", torch.float32, dict(hq=4, hkv=2, d=32, **{**CPU_ROWS, "splits": (5,)},
                                    row_splits=(2, 1, 9, 0, 5, 3)), 1e-5,
         id=shape_id(torch.float32, 4, 2, 32) + "-row-splits"),
    case("cpu", torch.float32, dict(hq=4, hkv=2, d=32, **{**CPU_ROWS, "seq_lens": (300, 90, 130, 70, 200, 0),
                                                          "splits": (4,)}, wide=(64, 40), row_splits=(1, 1, 2, 1, 4, 1)),
         1e-5, id=shape_id(torch.float32, 4, 2, 32) + "-row-splits-wide"),
    *(case("cuda", dtype, dict(hq=hq, hkv=hkv, d=d), 1e-2, id=shape_id(dtype, hq, hkv, d))
      for dtype in GPU_DTYPES for hq, hkv, d in GPU_SHAPES),
    case("cuda", torch.bfloat16, dict(hq=32, hkv=8, d=128, splits=(16,), row_splits=(3, 1, 5, 1, 16, 1)), 1e-2,
         id=shape_id(torch.bfloat16, 32, 8, 128) + "-row-splits"),
    # the dense row (700 keys in the GPU rows) with 64-key tiles
    case("cuda", torch.bfloat16, dict(hq=32, hkv=8, d=128, wide=(64, 512)), 1e-2,
         id=shape_id(torch.bfloat16, 32, 8, 128) + "-wide"),
]


@pytest.mark.parametrize("device,dtype,kw,tol", CASES)
def test_fast_decode(device, dtype, kw, tol):
    err = check_fast_decode(device, dtype, **kw)
    assert err < tol, (dtype, err)
