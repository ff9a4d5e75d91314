"""Kernel-vs-reference checks, shared by the GPU tests and the CPU run under Triton's interpreter.

Run directly: ``TRITON_INTERPRET=1 python tests/kernel_checks.py cpu`` (small sizes, float32/16).
"""

from __future__ import annotations

import sys

import torch

from sfi_vllm.attention_ref import fast_step_attention
from sfi_vllm.paged_kv import PagedKV


def paged_cache(num_blocks, page, hkv, d, dtype, device, gen):
    physical = torch.randn(num_blocks, page, hkv, 2 * d, generator=gen).to(device, dtype)
    kv = physical.permute(0, 2, 1, 3)  # vLLM's logical (nb, H, page, 2D) over the NHD layout
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    return PagedKV(kv, "flash", d), key_cache, value_cache


def block_tables(seq_lens, page, spare, gen, device):
    """Random, disjoint block tables for ``seq_lens``; returns ``(num_blocks, table)``."""
    blocks = [-(-s // page) for s in seq_lens]
    nb = sum(blocks) + spare
    perm = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        bt[i, :n] = perm[used:used + n]
        used += n
    return nb, bt.to(device)


def check_fast_decode(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                      seq_lens=(3000, 900, 5000, 257), compact=(300, 70, 1000, 4), window=(256, 300, 270, 200),
                      splits=(1, 3, 8), seed=0):
    from sfi_vllm_kernels.fast_decode import fast_decode_attention, make_workspace

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables(seq_lens, page, 5, g, device)
    paged, kc, vc = paged_cache(nb, page, hkv, d, dtype, device, g)
    slots = torch.tensor([5, 0, 2, 7][:B], dtype=torch.int32, device=device)
    cap = max(compact) + 3
    ck = torch.randn(8, hkv, cap, d, generator=g).to(device, dtype)
    cv = torch.randn(8, hkv, cap, d, generator=g).to(device, dtype)
    nc = torch.tensor(compact, dtype=torch.int32, device=device)
    ws = torch.tensor([s - w for s, w in zip(seq_lens, window)], dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    refs = []
    for b in range(B):
        s = int(slots[b])
        wk, wv = paged.gather_range(bt[b], int(ws[b]), seq_lens[b])
        refs.append(fast_step_attention(q[b], ck[s, :, : compact[b]], cv[s, :, : compact[b]], wk, wv, scale))
    ref = torch.stack(refs)
    worst = 0.0
    for ns in splits:
        out = torch.full_like(q, float("nan"))
        fast_decode_attention(q, ck, cv, kc, vc, bt, slots, nc, ws, sl, scale, ns, out=out,
                              workspace=make_workspace(B, hq, d, ns, device))
        assert not torch.isnan(out).any(), f"unwritten output (splits={ns})"
        err = ((out.float() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
    return worst


def check_repack(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(4000, 700, 2500),
                 counts=(1000, 130, 64), seed=1):
    from sfi_vllm_kernels.repack import repack

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


def run_all(device: str) -> None:
    if device == "cpu":  # Triton's interpreter: small shapes, no bf16 in numpy
        for dtype in (torch.float32, torch.float16):
            err = check_fast_decode("cpu", dtype, hq=4, hkv=2, d=32, page=16, seq_lens=(300, 90, 130),
                                    compact=(40, 3, 65), window=(70, 60, 50), splits=(1, 2))
            assert err < (1e-5 if dtype == torch.float32 else 5e-3), (dtype, err)
            check_repack("cpu", dtype, hkv=2, d=32, seq_lens=(300, 90), counts=(70, 20))
        print("kernel checks passed (interpreter)")
        return
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            err = check_fast_decode(device, dtype, hq=hq, hkv=hkv, d=d)
            assert err < 1e-2, (dtype, hq, d, err)
            check_repack(device, dtype, hkv=hkv, d=d)
    print("kernel checks passed (cuda)")


if __name__ == "__main__":
    run_all(sys.argv[1] if len(sys.argv) > 1 else "cuda")
