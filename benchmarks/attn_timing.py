"""Per-layer attention timings on the GPU, shared by kernel_bench.py, e2e_bench.py and the kernel sweeps.

Qwen3-4B attention shape (32 query / 8 KV heads, head_dim 128, bf16, page 16). Decode kernels are
timed under CUDA graphs (one launch captured, replayed many times, median per launch); the slow
step's selection work (score kernel + softmax + batched Selector + repack) is timed eagerly with
CUDA events, the way it runs in the engine.
"""

from __future__ import annotations

import statistics

import torch

HQ, HKV, D, PAGE = 32, 8, 128, 16
WINDOW, SINKS = 256, 4


def graph_time_us(fn, replays: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times)


def eager_time_us(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def setup(batch: int, context: int, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    blocks = -(-context // PAGE)
    nb = batch * blocks + 8
    kv = torch.randn(nb, PAGE, HKV, 2 * D, device=device, dtype=dtype, generator=g)
    key_cache, value_cache = kv[..., :D], kv[..., D:]
    bt = torch.randperm(nb - 8, device=device, generator=g)[: batch * blocks].view(batch, blocks).int()
    q = torch.randn(batch, HQ, D, device=device, dtype=dtype, generator=g)
    return kv, key_cache, value_cache, bt, q


def row_kinds(batch: int, context: int, q: torch.Tensor, working_set: int = 2308) -> tuple[tuple, dict]:
    """Per-row tables of the fast-step kernel for two kinds of uniform launch: ``dense``, every row
    attending its whole ``context`` (a bridge step's rows), and ``fast``, every row on a
    ``working_set``-token set (compact tokens + the ``WINDOW``-token paged window; 2,308: the
    default's 4 sinks + 2,048 selected + 256). Returns ``(compact_k, compact_v, row_min_window_start,
    seq_lens)`` and ``{kind: (row_slot, compact_len, window_start, bytes read)}``."""
    dev = q.device
    n_compact = working_set - WINDOW
    ck = torch.randn(batch, HKV, n_compact, D, device=dev, dtype=q.dtype)
    cv = torch.randn_like(ck)
    zeros = torch.zeros(batch, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    kinds = {
        "dense": (torch.full((batch,), -1, device=dev, dtype=torch.int32),
                  torch.zeros(batch, device=dev, dtype=torch.int32), zeros,
                  batch * context * HKV * D * 4),
        "fast": (torch.arange(batch, device=dev, dtype=torch.int32),
                 torch.full((batch,), n_compact, device=dev, dtype=torch.int32),
                 torch.full((batch,), context - WINDOW, device=dev, dtype=torch.int32),
                 batch * working_set * HKV * D * 4),
    }
    return (ck, cv, zeros, lens), kinds


def fa3_us(q, kc, vc, bt, lens, max_len) -> float:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    B = q.shape[0]
    cu_q = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    out = torch.empty_like(q)
    return graph_time_us(lambda: flash_attn_varlen_func(
        q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=lens, max_seqlen_k=max_len,
        softmax_scale=D ** -0.5, causal=True, block_table=bt, fa_version=3))


def sfi_fast_us(q, kc, vc, bt, lens, n_compact: int, window_start: int, uniform: bool = False) -> tuple[float, int]:
    """The fast-step kernel over ``n_compact`` compact tokens + the paged window from
    ``window_start``; ``uniform``: with the CUDA-graph split count of ``balanced_splits: false``
    (every row the same count; with every row of one kind, balanced splits took 0.99-1.03x that
    launch's time on an H100: benchmarks/results/balanced-splits-e2e-h100.md)."""
    from sfi_vllm.kernels.fast_decode import (default_num_splits, fast_decode_attention, make_workspace,
                                              uniform_num_splits)

    B = q.shape[0]
    ck = torch.randn(B, HKV, n_compact, D, device=q.device, dtype=q.dtype)
    cv = torch.randn_like(ck)
    row_slot = torch.arange(B, device=q.device, dtype=torch.int32)
    zeros = torch.zeros(B, device=q.device, dtype=torch.int32)
    nc = torch.full((B,), n_compact, device=q.device, dtype=torch.int32)
    ws = torch.full((B,), window_start, device=q.device, dtype=torch.int32)
    keys = n_compact + int(lens.max()) - window_start
    ns = uniform_num_splits(B, HKV) if uniform else default_num_splits(B, HKV, keys)
    work = make_workspace(B, HQ, D, ns, q.device)
    out = torch.empty_like(q)
    us = graph_time_us(lambda: fast_decode_attention(q, ck, cv, kc, vc, bt, row_slot, zeros, lens, nc, ws,
                                                     D ** -0.5, ns, out=out, workspace=work))
    return us, ns


def slow_select_us(kv, q, bt, context: int, cfg, fused_max_frame: int | None = None) -> float:
    """One layer's selection work at a slow step for every row (all rows slow), as
    ``PackedSFILayer._refresh_packed`` launches it: score kernel + the selection CUDA graph
    (``SlowStepSelection``, captured before timing), positions assembled, one repack.
    ``fused_max_frame`` overrides the engine's bound between the fused and the torch Selector
    (0: torch for every frame; a large number: fused for every frame)."""
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.compact import PackedCompactBuffer, selected_count, window_start
    from sfi_vllm.paged_kv import PagedKV
    from sfi_vllm.selector import Selector

    B = q.shape[0]
    paged = PagedKV(kv.permute(0, 2, 1, 3), "flash", D)
    kc, _ = paged.nhd_views()
    ws = window_start(cfg, context)
    k = selected_count(cfg, context)
    sinks = cfg.sinks
    buf = PackedCompactBuffer(B, HKV, sinks + k, D, q.dtype, q.device)
    sel = Selector(cfg.selector)
    # capture_after=1: the warm-up captures the graph, so the timed runs replay it (the engine's
    # steady state for a recurring shape)
    graphs = SlowStepSelection(capture_after=1, **({} if fused_max_frame is None else
                                                   {"fused_max_frame": fused_max_frame}))
    lens = torch.full((B,), context, device=q.device, dtype=torch.int32)

    def work():
        chosen = graphs.select(sel, q, kc, bt, lens, [context] * B, sinks, [ws] * B, [k] * B, D ** -0.5)
        pos = torch.empty(B, HKV, sinks + k, dtype=torch.long, device=q.device)
        pos[..., :sinks] = torch.arange(sinks, device=q.device)
        pos[..., sinks:] = chosen
        buf.pack_rows(list(range(B)), [1] * B, paged, bt, pos, [sinks + k] * B, [ws] * B)

    return eager_time_us(work)
