"""The repack kernels (``sfi_vllm.kernels.repack``: ``repack``, ``repack_selected``) against
``PagedKV.gather``."""

from __future__ import annotations

import pytest
import torch

from builders import GPU_DTYPES, GPU_SHAPES, block_tables, case, paged_cache, shape_id


def check_repack(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(4000, 700, 2500),
                 counts=(1000, 130, 64), seed=1):
    from sfi_vllm.kernels.repack import repack

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables(seq_lens, page, 2, g, device)
    paged, kc, vc = paged_cache(nb, page, hkv, d, dtype, device, g)
    C = max(counts)
    pos = torch.zeros(B, hkv, C, dtype=torch.int32)
    for b in range(B):
        for h in range(hkv):
            pos[b, h, : counts[b]] = torch.sort(torch.randperm(seq_lens[b], generator=g)[: counts[b]]).values
    pos = pos.to(device)
    slots = torch.tensor([3, 1, 0][:B], dtype=torch.int32, device=device)
    ck = torch.full((4, hkv, C + 2, d), float("nan"), dtype=dtype, device=device)
    cv = torch.full_like(ck, float("nan"))
    repack(kc, vc, bt, slots, pos, torch.tensor(counts, dtype=torch.int32, device=device), ck, cv)
    for b in range(B):
        k, v = paged.gather(bt[b], pos[b, :, : counts[b]].long())
        s = int(slots[b])
        assert torch.equal(ck[s, :, : counts[b]], k) and torch.equal(cv[s, :, : counts[b]], v)
        assert torch.isnan(ck[s, :, counts[b]:].float()).all()  # nothing written past the count
    return 0.0


def check_repack_selected(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(4000, 700, 2500),
                          k=(1000, 130, 64), sinks=4, seed=2):
    """``repack_selected`` against ``PagedKV.gather`` of sinks + the selection, and its metadata
    writes (what a publish writes on the device); padding past a row's ``k`` must be ignored, and
    a padding row (set ``-1``) writes nothing."""
    from sfi_vllm.kernels.repack import repack_selected

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables(seq_lens, page, 2, g, device)
    paged, kc, vc = paged_cache(nb, page, hkv, d, dtype, device, g)
    K = max(k)
    sel = torch.full((B, hkv, K), 10 ** 9, dtype=torch.long)  # padding: never read
    for b in range(B):
        for h in range(hkv):
            sel[b, h, : k[b]] = torch.sort(sinks + torch.randperm(seq_lens[b] - sinks, generator=g)[: k[b]]).values
    sel = sel.to(device)
    targets, slots = [5, 2, 0][:B], [2, 1, 0][:B]
    # a padding row (set -1) after the real ones: a copy of row 0 that must write nothing
    meta = torch.tensor([targets + [-1], [sinks + kk for kk in k] + [sinks + k[0]],
                         [s - 50 for s in seq_lens] + [7], slots + [slots[0]]], dtype=torch.int32, device=device)
    sel = torch.cat([sel, sel[:1]])
    bt = torch.cat([bt, bt[:1]])
    ck = torch.full((6, hkv, sinks + K + 2, d), float("nan"), dtype=dtype, device=device)
    cv = torch.full_like(ck, float("nan"))
    length = torch.full((6,), -1, dtype=torch.int32, device=device)
    wstart, smap = torch.full_like(length, -1), torch.full((3,), -1, dtype=torch.int32, device=device)
    repack_selected(kc, vc, bt, sel, sinks, meta, ck, cv, length, wstart, smap)
    for b in range(B):
        pos = torch.cat([torch.arange(sinks, device=device).expand(hkv, sinks), sel[b, :, : k[b]]], dim=1)
        kk, vv = paged.gather(bt[b], pos)
        t, n = targets[b], sinks + k[b]
        assert torch.equal(ck[t, :, :n], kk) and torch.equal(cv[t, :, :n], vv)
        assert torch.isnan(ck[t, :, n:].float()).all(), "nothing written past the row's tokens"
        assert int(length[t]) == n and int(wstart[t]) == seq_lens[b] - 50 and int(smap[slots[b]]) == t
    untouched = [i for i in range(6) if i not in targets]
    assert (length[untouched] == -1).all() and torch.isnan(ck[untouched].float()).all()
    return 0.0


CPU_DTYPES = (torch.float32, torch.float16)
GPU_HEADS = [(hkv, d) for _, hkv, d in GPU_SHAPES]


@pytest.mark.parametrize("device,dtype,kw", [
    *(case("cpu", dtype, dict(hkv=2, d=32, seq_lens=(300, 90), counts=(70, 20)), id=shape_id(dtype, hkv=2, d=32))
      for dtype in CPU_DTYPES),
    *(case("cuda", dtype, dict(hkv=hkv, d=d), id=shape_id(dtype, hkv=hkv, d=d))
      for dtype in GPU_DTYPES for hkv, d in GPU_HEADS),
])
def test_repack(device, dtype, kw):
    check_repack(device, dtype, **kw)


@pytest.mark.parametrize("device,dtype,kw", [
    *(case("cpu", dtype, dict(hkv=2, d=32, seq_lens=(300, 90), k=(70, 20)), id=shape_id(dtype, hkv=2, d=32))
      for dtype in CPU_DTYPES),
    *(case("cuda", dtype, dict(hkv=hkv, d=d), id=shape_id(dtype, hkv=hkv, d=d))
      for dtype in GPU_DTYPES for hkv, d in GPU_HEADS),
])
def test_repack_selected(device, dtype, kw):
    check_repack_selected(device, dtype, **kw)
