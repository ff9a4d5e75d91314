"""Kernel-vs-reference checks, shared by the GPU tests and the CPU run under Triton's interpreter.

Run directly: ``TRITON_INTERPRET=1 python tests/kernel_checks.py cpu`` (small sizes, float32/16);
``python tests/kernel_checks.py cuda`` (every check) or ``selection`` (the Selector's) on a GPU.
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


def device_batch(seq_lens, device, dtype, hq, hkv, d, seed=0):
    """``make_batch``'s paged cache, metadata and queries (one decode token per row) on ``device``."""
    from test_sfi_layer import make_batch

    paged_cpu, cam, q, _, _ = make_batch("flash", 16, list(seq_lens), [1] * len(seq_lens), hq=hq, hkv=hkv, d=d,
                                         seed=seed)
    cache = paged_cpu.kv_cache.permute(0, 2, 1, 3).contiguous().to(device, dtype).permute(0, 2, 1, 3)
    cam.block_table_tensor = cam.block_table_tensor.to(device)
    cam.seq_lens = cam.seq_lens.to(device)
    return PagedKV(cache, "flash", d), cam, q.to(device, dtype)


def check_fast_decode(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                      seq_lens=(3000, 900, 5000, 257, 700, 0), compact=(300, 70, 1000, 4, None, None),
                      window=(256, 300, 270, 200, None, None), min_ws=(0, 0, 4900, 0, 0, 0),
                      splits=(1, 3, 8), seed=0):
    """Rows with a compact set, a row whose window slides past its refresh point (``min_ws``), a
    dense row (no slot: ``compact`` None) and an empty padding row (``seq_len`` 0)."""
    from sfi_vllm_kernels.fast_decode import fast_decode_attention, make_workspace

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
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, row_min_ws, sl,
                              nc_by_slot.to(device), ws_by_slot.to(device), scale, ns, out=out,
                              workspace=make_workspace(B, hq, d, ns, device), stage=stage)
        assert not torch.isnan(out).any(), f"unwritten output (splits={ns})"
        if stage is not None:  # query staging: every row's q, nothing past the batch
            assert torch.equal(stage[:B], q) and torch.isnan(stage[B:].float()).all()
        err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
    return worst


def check_fused_scores(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                       seq_lens=(3000, 900, 2100, 700, 0), splits=(1, 3), seed=5):
    """The fast-step kernel's fused slow-step scores: rows 1 and 2 are dense and scored (one
    group of two rows, frame width past both contexts, written as layer 1 of 2), row 0 has a
    compact set and a frame base (ignored: only dense rows are scored), row 3 is dense and not
    scored, row 4 is padding. Their logits and key norms against the gathered keys; nothing
    written outside the two frames; the attention output the same as without scores."""
    from sfi_vllm_kernels.fast_decode import ScoreFrames, fast_decode_attention, make_workspace

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
    lead = 3  # tokens of frame space before the group's (another group's, say)
    base = torch.tensor([lead, lead, lead + width, -1, -1], dtype=torch.int32, device=device)
    stride = torch.full((B,), rows * width, dtype=torch.int32, device=device)
    wid = torch.full((B,), width, dtype=torch.int32, device=device)
    tokens = lead + layers * rows * width + 5
    worst = 0.0
    for ns in splits:
        plain = torch.full_like(q, float("nan"))
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, zeros, sl, nc, ws, scale, ns, out=plain,
                              workspace=make_workspace(B, hq, d, ns, device))
        logits = torch.full((tokens * hq,), float("nan"), device=device)
        norms = torch.full((tokens * hkv,), float("nan"), device=device)
        out = torch.full_like(q, float("nan"))
        fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, zeros, sl, nc, ws, scale, ns, out=out,
                              workspace=make_workspace(B, hq, d, ns, device),
                              scores=ScoreFrames(base, stride, wid, logits, norms, 1))
        assert torch.equal(out, plain), "the scores changed the attention output"
        lg = logits[(lead + rows * width) * hq:(lead + 2 * rows * width) * hq].view(rows, hkv, G, width)
        nm = norms[(lead + rows * width) * hkv:(lead + 2 * rows * width) * hkv].view(rows, hkv, width)
        for j, b in enumerate((1, 2)):
            n = seq_lens[b]
            keys, _ = paged.gather_range(bt[b], 0, n, want_values=False)
            ref = torch.einsum("hgd,hnd->hgn", q[b].float().view(hkv, G, d), keys.float()) * scale
            assert torch.all(lg[j, ..., n:] == float("-inf")) and torch.all(nm[j, :, n:] == 0)
            worst = max(worst, (lg[j, ..., :n].cpu() - ref.cpu()).abs().max().item())
            assert torch.allclose(nm[j, :, :n], keys.float().norm(dim=-1), rtol=1e-3, atol=1e-3)
        written = torch.zeros(tokens, dtype=torch.bool)
        written[lead + rows * width:lead + 2 * rows * width] = True
        assert torch.isnan(logits.view(tokens, hq)[~written]).all(), "logits written outside the frames"
        assert torch.isnan(norms.view(tokens, hkv)[~written]).all(), "norms written outside the frames"
    return worst


def check_top_k(device="cuda", rows=5, hkv=8, width=35000, lo=4, kmax=2048, block=1024, seed=6):
    """The top-K kernel against :func:`sfi_vllm.selector.top_k_positions` on scores without ties
    (negative and positive values, rows with ``-inf`` past their candidates, budgets below
    ``kmax``), and on scores with many ties against the kernel's documented rule (the lower
    positions win ties), written out with a stable sort."""
    from sfi_vllm.selector import top_k_positions
    from sfi_vllm_kernels.top_k import top_k_positions as top_k_kernel

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


def check_slow_scores(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                      seq_lens=(3000, 77, 1290), seed=2):
    """Logits -> probabilities and key norms against ``attention_probs`` on the gathered keys."""
    from sfi_vllm.attention_ref import attention_probs
    from sfi_vllm_kernels.slow_scores import slow_step_scores

    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nb, bt = block_tables(seq_lens, page, 3, g, device)
    paged, kc, _ = paged_cache(nb, page, hkv, d, dtype, device, g)
    q = torch.randn(B, hq, d, generator=g).to(device, dtype)
    scale = d ** -0.5
    width = max(seq_lens) + 5
    logits, norms = slow_step_scores(q, kc, bt, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                     width, scale)
    probs = torch.softmax(logits, dim=-1)
    worst = 0.0
    for b, n in enumerate(seq_lens):
        keys, _ = paged.gather_range(bt[b], 0, n, want_values=False)
        ref = attention_probs(q[b], keys, scale)
        assert torch.all(probs[b, ..., n:] == 0) and torch.all(norms[b, :, n:] == 0)
        worst = max(worst, (probs[b, ..., :n] - ref).abs().max().item())
        assert torch.allclose(norms[b, :, :n], keys.float().norm(dim=-1), rtol=1e-3, atol=1e-3)
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


def check_repack_selected(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(4000, 700, 2500),
                          k=(1000, 130, 64), sinks=4, seed=2):
    """``repack_selected`` against ``PagedKV.gather`` of sinks + the selection, and its metadata
    writes (what a publish writes on the device); padding past a row's ``k`` must be ignored."""
    from sfi_vllm_kernels.repack import repack_selected

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
    meta = torch.tensor([targets, [sinks + kk for kk in k], [s - 50 for s in seq_lens], slots],
                        dtype=torch.int32, device=device)
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


def check_packed_layer(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                       seq_lens=(3000, 900, 5000, 1400), retention=0.15, policy="sfi", refresh="per_layer"):
    """The GPU layer path (score kernel + batched Selector + one repack; fast rows through the
    step's tables; the uniform all-rows launch with a dense row and a padding row) against the
    reference layer (per-row torch selector, gathered keys, reference attention)."""
    from sfi_vllm.backends.common import FastRows, SFILayer, attach_fast_tables, fast_row_tables, make_step
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from sfi_vllm_kernels.fast_decode import uniform_workspace_numel
    from test_sfi_layer import fake_vllm_config, plan_for

    n = len(seq_lens)
    over = {"boundary_token_ids": [7], "min_gap": 0, "slow_refresh": refresh,
            **policy_overrides(policy, retention, max(seq_lens))}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over))
    cfg = ctl.cfg
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)  # first: its buffer feeds the stats
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    # a second GPU-path layer over the same step: it reuses what the first left in the step's
    # layer cache (index tensors, positions buffer, repack metadata) and must match as well
    packed2 = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast2 = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed2)
    paged, cam, qd = device_batch(seq_lens, device, dtype, hq, hkv, d)
    ctx = list(seq_lens)
    slow = make_step(plan_for([StepMode.SLOW] * n, cfg=cfg, context=ctx), cam, lambda s: None)
    # the fast step: one token later for every row (the window slides by one)
    modes = [StepMode.FAST] * (n - 1) + [StepMode.DENSE]
    step = make_step(plan_for(modes, cfg=cfg, context=ctx), cam, lambda s: None)
    attach_fast_tables(step, cam, ctl)
    outs = []
    for layer in (ref, fast, fast2):
        layer.refresh(slow, paged, qd, 0)
        ctl.end_step()  # the runner hook after the forward (runs a per-step refresh)
        ctl.join_refresh()  # what the metadata builder does at the start of the next step
        out = torch.full_like(qd, float("nan"))
        layer.fast(step, paged, qd, out)
        outs.append(out[: n - 1].float().cpu())
    same = 0
    for row in range(n):
        entry = ref.buffer.get(row, 1)
        k = entry.num_tokens
        assert packed.length[row] == k and packed.window_start[row] == entry.window_start
        phys = packed.slot_map[row]
        assert int(packed.slot_map_dev[row]) == phys
        assert int(packed.length_dev[phys]) == k and int(packed.window_start_dev[phys]) == entry.window_start
        ref_keys = entry.keys.to(dtype).cpu()
        got = packed.published_keys(row).cpu()
        same += (got == ref_keys).all(-1).float().mean().item()
    assert same / n > 0.97, f"selections differ: {same / n:.3f} of tokens identical"
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 2e-2, f"fast rows: {err}"
    assert torch.equal(outs[2], outs[1]), "a second layer of the same step (cached step tensors) differs"
    assert slow.layer_cache, "the step's layer cache was not used"
    # the uniform launch: the same fast rows, the last row dense, one padding row (seq_len 0)
    tables = torch.zeros(2, n + 1, dtype=torch.int32)
    tables[:, :n] = fast_row_tables(step.plan, list(range(n)))
    tables[0, n] = -1
    uni = FastRows(rows=n + 1, slot=tables[0].to(device), min_window_start=tables[1].to(device),
                   seq_lens=torch.tensor(ctx + [0], dtype=torch.int32, device=device),
                   block_table=torch.cat([cam.block_table_tensor, cam.block_table_tensor[:1]]))
    qu = torch.cat([qd, qd[:1]])
    out = torch.full_like(qu, float("nan"))
    ws = torch.empty(uniform_workspace_numel(8, hq, hkv, d), dtype=torch.float32, device=device)
    fast.fast_uniform(uni, paged, qu, out, ws)
    out = out.float().cpu()
    err = ((out[: n - 1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 2e-2, f"uniform fast rows: {err}"
    from sfi_vllm.attention_ref import dense_attention

    keys, values = paged.gather_range(cam.block_table_tensor[n - 1], 0, ctx[-1])
    dense = dense_attention(qd[n - 1], keys, values, d ** -0.5).cpu()
    assert ((out[n - 1] - dense).norm() / dense.norm()).item() < 2e-2, "dense row"
    assert torch.all(out[n] == 0), "padding row"
    return err


def refresh_stacks(configs, hq, hkv, d, dtype, device, layers):
    """One controller per config (dicts), each with ``layers`` GPU-path layers (double-buffered)."""
    from sfi_vllm.backends.common import SFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from test_sfi_layer import fake_vllm_config

    ctls, stacks = [], []
    for over in configs:
        ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over))
        cap = ctl.cfg.compact_capacity(8192)
        stacks.append([SFILayer(ctl, hq, hkv, d, scale=d ** -0.5,
                                packed=PackedCompactBuffer(8, hkv, cap, d, dtype, device, double_buffer=True))
                       for _ in range(layers)])
        ctls.append(ctl)
    return ctls, stacks


def assert_same_sets(ref_stack, stack, rows: int, values: bool = False) -> None:
    """Layer by layer, the same published compact sets (host mirrors, device metadata, >99% of the
    tokens; with ``values`` the V rows too)."""
    for a_layer, b_layer in zip(ref_stack, stack):
        a, b = a_layer.packed, b_layer.packed
        assert a.slot_map == b.slot_map and a.length == b.length and a.window_start == b.window_start
        assert a.generation == b.generation
        assert torch.equal(a.slot_map_dev.cpu(), b.slot_map_dev.cpu())
        for row in range(rows):
            phys = a.slot_map[row]
            assert int(b.length_dev[phys]) == a.length[row] and int(b.window_start_dev[phys]) == a.window_start[row]
            same = (a.published_keys(row) == b.published_keys(row)).all(-1).float().mean().item()
            assert same > 0.99, f"row {row}: {same:.3f} of the compact set identical"
            if values:
                n_tok = a.length[row]
                same_v = (a.values[phys, :, :n_tok] == b.values[phys, :, :n_tok]).all(-1).float().mean().item()
                assert same_v > 0.99, f"row {row}: {same_v:.3f} of the compact values identical"


def check_step_refresh(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                       seq_lens=(3000, 900, 5000, 1400), layers=3, steps=4, retention=0.15, chunk_bytes=None):
    """``slow_refresh = "per_step"`` (queries staged per layer, every layer selected and repacked
    when the step ends, replayed from a CUDA graph) against ``"per_layer"``, layer by layer: each
    layer has its own cache and queries, so a mixed-up layer shows. Several slow steps with new
    data: on CUDA the first runs eagerly, the second captures, the later ones replay (and must
    read their own inputs). ``chunk_bytes`` small: one layer per Selector launch."""
    from sfi_vllm.backends.common import make_step
    from sfi_vllm.backends.step_refresh import StepRefresh
    from sfi_vllm.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import plan_for

    n = len(seq_lens)
    base = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", retention, max(seq_lens))}
    ctls, stacks = refresh_stacks([{**base, "slow_refresh": m} for m in ("per_layer", "per_step")],
                                  hq, hkv, d, dtype, device, layers)
    ctls[1]._step_refresh = StepRefresh(capture_after=2, **({} if chunk_bytes is None else {"logits_bytes": chunk_bytes}))
    g = torch.Generator().manual_seed(11)
    paged0, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=7)
    # each layer's cache, allocated once (an engine's caches persist; a graph holds their addresses)
    pageds = [PagedKV(paged0.kv_cache.clone(), "flash", d) for _ in range(layers)]
    for _ in range(steps):
        for p in pageds:  # new data in place
            p.kv_cache.copy_(paged0.kv_cache + 0.7 * torch.randn(paged0.kv_cache.shape, generator=g).to(device, dtype))
        qs = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
        for ctl, stack in zip(ctls, stacks):
            step = make_step(plan_for([StepMode.SLOW] * n, cfg=ctl.cfg, context=list(seq_lens)), cam, lambda s: None)
            for li, layer in enumerate(stack):
                layer.refresh(step, pageds[li], qs[li], li)
            ctl.end_step()  # the per-step refresh runs here
            ctl.join_refresh()
        assert not ctls[1].step_refresh.pending
        assert_same_sets(stacks[0], stacks[1], n, values=True)
    sr = ctls[1].step_refresh
    if device == "cuda":
        assert (sr.eager_runs, sr.captures, sr.replays) == (1, 1, steps - 2), (sr.eager_runs, sr.captures, sr.replays)
    return 0.0


def check_graph_slow(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                     seq_lens=(3000, 900, 5000, 1400), layers=3, steps=4, retention=0.15, fused=False,
                     top_k="torch"):
    """``slow_in_graph``: a slow step run as a uniform step (the fast-step kernel attends densely
    for the slow rows and stages every row's query; the refresh runs from the plan when the step
    ends) against the per-layer refresh of the same queries, layer by layer, and the slow rows'
    outputs against dense attention. On CUDA the later steps replay the refresh graph. ``fused``
    (``fused_scores_tokens``): the kernel also writes the slow rows' logits and key norms, and
    the refresh reads them instead of running the score kernel. ``top_k``: ``selector_top_k`` of
    the graph step's engine (the reference's is torch's)."""
    from sfi_vllm.attention_ref import dense_attention
    from sfi_vllm.backends.common import make_step, uniform_tables
    from sfi_vllm.backends.step_refresh import FusedScoreBuffers, StepRefresh
    from sfi_vllm.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from sfi_vllm_kernels.fast_decode import uniform_workspace_numel
    from test_sfi_layer import plan_for

    n = len(seq_lens)
    base = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("sfi", retention, max(seq_lens))}
    # fused: room for the step's frames (one group: every row gets the largest context rounded up
    # to 2048) and no more
    tokens = n * -(-max(seq_lens) // 2048) * 2048 if fused else 0
    (ref_ctl, ctl), stacks = refresh_stacks([{**base, "slow_refresh": "per_layer"},
                                             {**base, "slow_refresh": "per_step", "slow_in_graph": True,
                                              "fused_scores_tokens": tokens, "selector_top_k": top_k}],
                                            hq, hkv, d, dtype, device, layers)
    ctl._step_refresh = StepRefresh(capture_after=2)
    ctl.graph_slow_ready = True  # as the CUDA impl sets it when its layers get query stages
    if fused:  # as the CUDA impl allocates them
        ctl.fused_scores = FusedScoreBuffers.allocate(tokens, layers, hq, hkv, device)
    assert ctl._slow_rows_fit_graph([ctl.cfg] * n, list(seq_lens))
    g = torch.Generator().manual_seed(13)
    paged0, cam, _ = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=9)
    pageds = [PagedKV(paged0.kv_cache.clone(), "flash", d) for _ in range(layers)]
    for layer, p in zip(stacks[1], pageds):
        layer.stage = torch.full((n + 2, hq, d), float("nan"), dtype=dtype, device=device)
        layer.kv = p.nhd_views()
    persistent = torch.zeros(5 if fused else 2, n, dtype=torch.int32, device=device)
    ws = torch.empty(uniform_workspace_numel(n, hq, hkv, d), dtype=torch.float32, device=device)
    for _ in range(steps):
        for p in pageds:
            p.kv_cache.copy_(paged0.kv_cache + 0.7 * torch.randn(paged0.kv_cache.shape, generator=g).to(device, dtype))
        qs = [torch.randn(n, hq, d, generator=g).to(device, dtype) for _ in range(layers)]
        # reference: the per-layer refresh of an eager slow step
        step = make_step(plan_for([StepMode.SLOW] * n, cfg=ref_ctl.cfg, context=list(seq_lens)), cam, lambda s: None)
        for li, layer in enumerate(stacks[0]):
            layer.refresh(step, pageds[li], qs[li], li)
        ref_ctl.end_step()
        ref_ctl.join_refresh()
        # the same slow step as a uniform step
        plan = plan_for([StepMode.SLOW] * n, cfg=ctl.cfg, context=list(seq_lens))
        plan.graph_slow = True
        assert not plan.needs_eager
        if fused:
            plan.score_layout = ctl._score_layout(plan)
            assert plan.score_layout is not None
            ctl.fused_scores.logits.fill_(float("nan"))  # what the refresh reads must be this step's
            ctl.fused_scores.norms.fill_(float("nan"))
        tables = uniform_tables(plan, cam, persistent, ctl)
        for li, layer in enumerate(stacks[1]):
            out = torch.full_like(qs[li], float("nan"))
            layer.fast_uniform(tables, pageds[li], qs[li], out, ws)
            assert torch.equal(layer.stage[:n], qs[li]), "query staging"
            for r in (0, n - 1):  # slow rows attend densely
                keys, values = pageds[li].gather_range(cam.block_table_tensor[r], 0, seq_lens[r])
                dense = dense_attention(qs[li][r], keys, values, d ** -0.5).float().cpu()
                assert ((out[r].float().cpu() - dense).norm() / dense.norm()).item() < 2e-2, "dense slow row"
        ctl.note_graph_slow(plan, cam.block_table_tensor)
        ctl.end_step()
        ctl.join_refresh()
        assert not ctl.step_refresh.pending
        assert_same_sets(stacks[0], stacks[1], n)
    sr = ctl.step_refresh
    assert any(key[2] == ("fused", 0) for key in sr._entries) == fused, "fused scores used" 
    if device == "cuda":
        assert (sr.eager_runs, sr.captures, sr.replays) == (1, 1, steps - 2), (sr.eager_runs, sr.captures, sr.replays)
    return 0.0


def check_selection_replay(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
                           seq_lens=(3000, 2900, 2500), k=(300, 300, 250), seed=4):
    """SlowStepSelection (CUDA graph per shape) against the eager batched Selector, for three
    different batches of the same shape: the first runs eagerly, the second captures, the third
    replays (``capture_after=2``), and each must read its own inputs."""
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.config import SelectorConfig
    from sfi_vllm.selector import Selector, select_batched
    from sfi_vllm_kernels.slow_scores import slow_step_scores

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


def check_selector_scores(device="cuda", hkv=8, g=4, frame=6000, lo=4, seq_lens=(6000, 3100, 900, 40),
                          window=256, kmax=512, seed=5, block=1024, variants=None, launch=None):
    """The fused selector kernels against the batched torch Selector (steps 1-5 compared as scores,
    step 6 as selections) for the default settings and each ablation's switches. ``block`` sets the
    statistics passes' tile, and with it how many splits of the frame they use; ``launch``, other
    launch parameters of ``selector_scores`` (those ``benchmarks/selector_bench.py`` times)."""
    from sfi_vllm.config import SelectorConfig
    from sfi_vllm.selector import Selector, batched_scores_static, top_k_positions
    from sfi_vllm_kernels.selector_scores import selector_scores

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
                    paper, {**paper, "use_prior": False}, {**paper, "nms_radius": 3, "alpha": 1.0},
                    {**paper, "use_nms": False, "use_exclusivity": False}]
    for over in variants:
        for rows in (1, 2):
            cfg = SelectorConfig(**over)
            ref = batched_scores_static(Selector(cfg), torch.softmax(logits, -1), norms, lo, n, rows)
            got = selector_scores(cfg, logits, norms, lo, n, rows, block=block, **(launch or {}))
            assert got.shape == ref.shape, (got.shape, ref.shape)
            fin = torch.isfinite(ref)
            assert torch.equal(fin, torch.isfinite(got)), (over, "-inf pattern")
            err = (got[fin] - ref[fin]).abs().max().item()
            assert err < 2e-3, (over, rows, err)
            worst = max(worst, err)
            a = top_k_positions(got, lo, k, int(k.max()))
            r = top_k_positions(ref, lo, k, int(k.max()))
            for b in range(B):
                kk = int(k[b])
                same = sum(len(set(a[b, h, :kk].tolist()) & set(r[b, h, :kk].tolist())) for h in range(hkv))
                assert same / (hkv * kk) > 0.99, (over, b, same / (hkv * kk))
    return worst


def check_double_buffer(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(900, 500),
                        counts=(70, 40), seed=6):
    """A repack writes the slot's spare set and leaves the published one untouched until it is
    published (poisoned spares show any read of the wrong set)."""
    from sfi_vllm.compact import PackedCompactBuffer

    g = torch.Generator().manual_seed(seed)
    nb, bt = block_tables(seq_lens, page, 2, g, device)
    paged, kc, _ = paged_cache(nb, page, hkv, d, dtype, device, g)
    buf = PackedCompactBuffer(3, hkv, 128, d, dtype, device, double_buffer=True)
    buf.keys.fill_(float("nan"))
    buf.values.fill_(float("nan"))
    slots = [2, 0]

    def positions():
        pos = torch.zeros(len(seq_lens), hkv, max(counts), dtype=torch.long)
        for b, (s, c) in enumerate(zip(seq_lens, counts)):
            for h in range(hkv):
                pos[b, h, :c] = torch.randperm(s, generator=g)[:c].sort().values
        return pos.to(device)

    def expect(pos, b):
        return torch.stack([kc[bt[b, pos[b, h, :counts[b]] // page].long(), pos[b, h, :counts[b]] % page, h]
                            for h in range(hkv)])

    first = positions()
    buf.pack_rows(slots, [1, 1], paged, bt, first, list(counts), [800, 450])
    old_map = list(buf.slot_map)
    for b, slot in enumerate(slots):
        assert torch.equal(buf.published_keys(slot), expect(first, b))
    second = positions()
    targets = buf.pack_rows(slots, [2, 2], paged, bt, second, list(counts), [850, 460], publish=False)
    assert buf.slot_map == old_map and buf.slot_map_dev.tolist() == old_map, "published before publish()"
    for b, slot in enumerate(slots):
        assert targets[b] != old_map[slot] and targets[b] // 2 == slot, "repack must write the spare set"
        assert torch.equal(buf.published_keys(slot), expect(first, b)), "the published set was overwritten"
        assert torch.equal(buf.keys[targets[b], :, :counts[b]], expect(second, b))
    dev_targets = torch.tensor(targets, dtype=torch.int32, device=device)
    buf.publish(slots, [2, 2], targets, list(counts), [850, 460],
                torch.tensor(slots, device=device), dev_targets)
    assert buf.slot_map_dev.tolist() == buf.slot_map and buf.slot_map[1] == old_map[1]
    for b, slot in enumerate(slots):
        assert torch.equal(buf.published_keys(slot), expect(second, b))
        assert int(buf.window_start_dev[targets[b]]) == (850, 460)[b]
    return 0.0


def check_refresh_ordering(dtype=torch.bfloat16, hq=32, hkv=8, d=128, seq_lens=(12000, 5000, 9000),
                           retention=0.1, sleep_cycles=200_000_000, refresh="per_layer"):
    """CUDA only: the slow step's refresh runs on the second stream, ordered by events. The refresh
    stream is held up (a sleep kernel) while a second slow step's refresh is enqueued; a fast step
    issued before the join must read the previous (published) sets exactly, one issued after the
    join the new ones. Fails if publication is not ordered after the repack on the refresh stream
    (the poisoned spare sets would be read) or if the join does not wait (the old sets would be)."""
    from sfi_vllm.backends.common import SFILayer, attach_fast_tables, make_step
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import fake_vllm_config, plan_for

    device = "cuda"
    n = len(seq_lens)
    over = {"boundary_token_ids": [7], "min_gap": 0, "slow_refresh": refresh,
            **policy_overrides("sfi", retention, max(seq_lens))}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over))
    assert ctl.cfg.side_stream
    packed = PackedCompactBuffer(4, hkv, ctl.cfg.compact_capacity(max(seq_lens)), d, dtype, device, double_buffer=True)
    fast = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    paged, cam, q1 = device_batch(seq_lens, device, dtype, hq, hkv, d)
    ctx = list(seq_lens)
    q2 = torch.randn(q1.shape, generator=torch.Generator().manual_seed(11)).to(device, dtype)
    slow = make_step(plan_for([StepMode.SLOW] * n, cfg=ctl.cfg, context=ctx), cam, lambda s: None)
    step = make_step(plan_for([StepMode.FAST] * n, cfg=ctl.cfg, context=ctx), cam, lambda s: None)
    attach_fast_tables(step, cam, ctl)

    def read() -> torch.Tensor:
        out = torch.full_like(q1, float("nan"))
        fast.fast(step, paged, q1, out)
        return out

    fast.refresh(slow, paged, q1, 0)
    ctl.end_step()
    ctl.join_refresh()
    old = read()
    torch.cuda.synchronize()
    assert torch.isfinite(old).all()
    # poison every spare set, hold the refresh stream up, enqueue the second refresh
    for slot in range(n):
        packed.keys[packed.target(slot)] = float("nan")
        packed.values[packed.target(slot)] = float("nan")
    side = ctl.refresh_stream(torch.device(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(sleep_cycles)
    fast.refresh(slow, paged, q2, 0)
    ctl.end_step()
    during = read()  # no join: must see the published (first) sets
    ctl.join_refresh()
    after = read()
    torch.cuda.synchronize()
    assert side.query()  # the refresh stream has drained
    assert torch.equal(during, old), "a fast step before the join read something other than the published sets"
    # the reference for the second selection: the same refresh inline (no second stream)
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5,
                   packed=PackedCompactBuffer(4, hkv, packed.capacity, d, dtype, device, double_buffer=True))
    q_rows = q2[torch.tensor([slow.row_token[r] for r in range(n)], device=device)]
    ref._refresh_packed(slow, paged, q_rows, cam.block_table_tensor[:n].to(torch.int32), list(range(n)))
    out_ref = torch.full_like(q1, float("nan"))
    ref.fast(step, paged, q1, out_ref)
    torch.cuda.synchronize()
    assert torch.isfinite(after).all(), "a fast step after the join read a poisoned (unwritten) set"
    assert torch.equal(after, out_ref), "after the join the fast step must read the new sets"
    assert not torch.equal(after, old), "test inconclusive: both selections gave the same output"
    return 0.0


def check_quest_layer(device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128,
                      seq_lens=(3000, 900, 5000, 1400, 150, 40), retention=0.15):
    """Quest-style fast rows through the kernel path (page-score kernel, top pages, repack,
    fast-step kernel) against the reference layer's per-row ``_quest_set``; the rows include one
    whose pages all fit the budget (they join the window) and one with no whole page."""
    from sfi_vllm.backends.common import SFILayer, make_step
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from sfi_vllm.policies import policy_overrides
    from sfi_vllm.trigger import StepMode
    from test_sfi_layer import fake_vllm_config, plan_for

    n = len(seq_lens)
    over = {"boundary_token_ids": [7], "min_gap": 0, **policy_overrides("quest", retention, 3000)}
    ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over))
    cfg = ctl.cfg
    packed = PackedCompactBuffer(8, hkv, cfg.compact_capacity(8192), d, dtype, device, double_buffer=True)
    fast = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5, packed=packed)
    ref = SFILayer(ctl, hq, hkv, d, scale=d ** -0.5)
    paged, cam, qd = device_batch(seq_lens, device, dtype, hq, hkv, d, seed=3)
    step = make_step(plan_for([StepMode.FAST] * n, cfg=cfg, context=list(seq_lens)), cam, lambda s: None)
    kinds = set()
    for r, c in enumerate(seq_lens):
        from sfi_vllm.compact import window_start
        w = window_start(cfg, c)
        pages = (w - cfg.sinks) // cfg.quest_page
        budget = min(pages, cfg.selected_budget(c) // cfg.quest_page)
        kinds.add("scored" if 0 < budget < pages else "all" if budget == pages and pages else "none")
    assert kinds == {"scored", "all", "none"}, kinds
    outs = []
    for layer in (ref, fast):
        out = torch.full_like(qd, float("nan"))
        layer.fast(step, paged, qd, out)
        outs.append(out.float().cpu())
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert torch.isfinite(outs[1]).all() and err < 2e-2, f"quest rows: {err}"
    return err


def run_all(device: str) -> None:
    if device == "cpu":  # Triton's interpreter: small shapes, no bf16 in numpy
        for dtype in (torch.float32, torch.float16):
            err = check_fast_decode("cpu", dtype, hq=4, hkv=2, d=32, page=16,
                                    seq_lens=(300, 90, 130, 70, 45, 0), compact=(40, 3, 65, 2, None, None),
                                    window=(70, 60, 50, 20, None, None), min_ws=(0, 0, 100, 0, 0, 0),
                                    splits=(1, 2))
            assert err < (1e-5 if dtype == torch.float32 else 5e-3), (dtype, err)
            err = check_slow_scores("cpu", dtype, hq=4, hkv=2, d=32, seq_lens=(150, 33))
            assert err < (1e-5 if dtype == torch.float32 else 2e-3), (dtype, err)
            err = check_fused_scores("cpu", dtype, hq=4, hkv=2, d=32, seq_lens=(200, 90, 130, 70, 0))
            assert err < (1e-4 if dtype == torch.float32 else 2e-2), (dtype, err)
            check_repack("cpu", dtype, hkv=2, d=32, seq_lens=(300, 90), counts=(70, 20))
            check_repack_selected("cpu", dtype, hkv=2, d=32, seq_lens=(300, 90), k=(70, 20))
        check_top_k("cpu", rows=5, hkv=2, width=700, kmax=64, block=128)
        check_double_buffer("cpu", torch.float32, hkv=2, d=32)
        err = check_quest_layer("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(900, 400, 1300, 500, 60))
        assert err < 1e-4, err
        check_packed_layer("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(600, 300, 900, 400))
        check_selection_replay("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(300, 290, 250), k=(30, 30, 25))
        check_step_refresh("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(300, 150, 420, 200), layers=2,
                           steps=2)
        check_graph_slow("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(300, 150, 420, 200), layers=2, steps=1)
        check_graph_slow("cpu", torch.float32, hq=6, hkv=3, d=32, seq_lens=(300, 150, 420, 200), layers=2, steps=1,
                         fused=True, top_k="triton")
        check_selector_scores("cpu", hkv=3, g=3, frame=700, seq_lens=(700, 400, 90, 20), window=32, kmax=64)
        # 64-token tiles: the statistics passes split the frame 11 ways, some splits past a row's end
        check_selector_scores("cpu", hkv=3, g=3, frame=700, seq_lens=(700, 400, 90, 20), window=32, kmax=64,
                              block=64, variants=[{}, {"use_prior": False},
                                                  {"page_size": 0, "use_nms": True, "follow_pages": 0}])
        # other launch parameters: more splits, 8 warps, small pointwise and soft-NMS tiles
        check_selector_scores("cpu", hkv=3, g=3, frame=700, seq_lens=(700, 400, 90, 20), window=32, kmax=64,
                              block=128, variants=[{}], launch=dict(target_programs=4096, num_warps=8, tile=64,
                                                                    nms_tile=32, nms_elems=128))
        print("kernel checks passed (interpreter)")
        return
    check_top_k(device)
    check_top_k(device, rows=4, hkv=8, width=131072, block=2048)
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            err = check_fast_decode(device, dtype, hq=hq, hkv=hkv, d=d)
            assert err < 1e-2, (dtype, hq, d, err)
            err = check_slow_scores(device, dtype, hq=hq, hkv=hkv, d=d)
            assert err < 2e-3, (dtype, hq, d, err)
            err = check_fused_scores(device, dtype, hq=hq, hkv=hkv, d=d)
            assert err < 5e-2, (dtype, hq, d, err)
            check_repack(device, dtype, hkv=hkv, d=d)
            check_repack_selected(device, dtype, hkv=hkv, d=d)
            for policy in ("sfi", "streaming", "snapkv"):
                check_packed_layer(device, dtype, hq=hq, hkv=hkv, d=d, policy=policy)
            check_packed_layer(device, dtype, hq=hq, hkv=hkv, d=d, refresh="per_step")
            check_selection_replay(device, dtype, hq=hq, hkv=hkv, d=d)
            check_step_refresh(device, dtype, hq=hq, hkv=hkv, d=d)
            check_step_refresh(device, dtype, hq=hq, hkv=hkv, d=d, chunk_bytes=1)
            check_graph_slow(device, dtype, hq=hq, hkv=hkv, d=d)
            check_graph_slow(device, dtype, hq=hq, hkv=hkv, d=d, fused=True)
            check_graph_slow(device, dtype, hq=hq, hkv=hkv, d=d, top_k="triton")
    check_double_buffer(device)
    check_refresh_ordering()
    check_refresh_ordering(refresh="per_step")
    for dtype in (torch.bfloat16, torch.float16):
        check_quest_layer(device, dtype)
        check_quest_layer(device, dtype, hq=9, hkv=3, d=64)
    check_selector_scores(device)
    check_selector_scores(device, hkv=3, g=3, frame=9000, seq_lens=(9000, 8100, 300, 7000))
    check_selector_scores(device, frame=131072, seq_lens=(131072, 70000), kmax=2048)  # 32 splits
    # launch parameters other than the defaults, the extremes of those benchmarks/selector_bench.py times
    # (the second: the earlier defaults)
    for block, launch in ((2048, dict(target_programs=2048, num_warps=8, tile=256, nms_tile=256, nms_elems=2048)),
                          (1024, dict(target_programs=512, num_warps=4, tile=256, nms_tile=256, nms_elems=2048)),
                          (512, dict(target_programs=4096, num_warps=4, tile=256, nms_tile=512, nms_elems=4096))):
        check_selector_scores(device, frame=40000, seq_lens=(40000, 33000), kmax=2048, block=block, variants=[{}],
                              launch=launch)
    print("kernel checks passed (cuda)")


def run_selection(device: str = "cuda") -> None:
    """The checks a change to the Selector or its settings needs: the fused Selector against the
    torch one at three frames (9 variants each), and the layers' slow steps that use it (per layer,
    per step, inside a CUDA graph with and without fused scores) at both tested shapes."""
    check_selector_scores(device)
    check_selector_scores(device, hkv=3, g=3, frame=9000, seq_lens=(9000, 8100, 300, 7000))
    check_selector_scores(device, frame=131072, seq_lens=(131072, 70000), kmax=2048)
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        check_packed_layer(device, torch.bfloat16, hq=hq, hkv=hkv, d=d, policy="sfi")
        check_packed_layer(device, torch.bfloat16, hq=hq, hkv=hkv, d=d, refresh="per_step")
        check_step_refresh(device, torch.bfloat16, hq=hq, hkv=hkv, d=d)
        check_graph_slow(device, torch.bfloat16, hq=hq, hkv=hkv, d=d)
        check_graph_slow(device, torch.bfloat16, hq=hq, hkv=hkv, d=d, fused=True)
    print(f"selection kernel checks passed ({device})")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if what == "selection":
        run_selection("cuda")
    else:
        run_all(what)
