"""Inputs shared by the kernel tests (paged caches, block tables, the reference layer's batch,
stacks of GPU-path layers) and the parametrization helpers that name their cases."""

from __future__ import annotations

import pytest
import torch

from sfi_vllm.paged_kv import PagedKV

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# the GPU cases' head shapes: Qwen3-4B's (hq, hkv, d) and SmolLM2's
GPU_SHAPES = ((32, 8, 128), (9, 3, 64))
GPU_DTYPES = (torch.bfloat16, torch.float16)


def shape_id(dtype=None, hq=None, hkv=None, d=None) -> str:
    """``hq32-hkv8-d128-bf16`` (the parts given)."""
    parts = [f"{k}{v}" for k, v in (("hq", hq), ("hkv", hkv), ("d", d)) if v is not None]
    return "-".join(parts + ([DTYPE_NAMES[dtype]] if dtype is not None else []))


def case(device: str, *values, id: str, selection: bool = False):
    """One parametrized case on ``device``: "cpu" runs in Triton's interpreter (marker
    ``interpreter``), "cuda" on the GPU (``gpu``; ``selection``: one of the checks a change to the
    Selector needs). The id is ``<device>-<id>``."""
    marks = [pytest.mark.interpreter] if device == "cpu" else [pytest.mark.gpu]
    if selection:
        marks.append(pytest.mark.selection)
    return pytest.param(device, *values, id=f"{device}-{id}", marks=marks)


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


def device_batch(seq_lens, device, dtype, hq, hkv, d, seed=0, query_lens=None):
    """``make_batch``'s paged cache, metadata and queries (one decode token per row, or
    ``query_lens``) on ``device``."""
    from test_sfi_layer import make_batch

    query_lens = list(query_lens or [1] * len(seq_lens))
    paged_cpu, cam, q, _, _ = make_batch("flash", 16, list(seq_lens), query_lens, hq=hq, hkv=hkv, d=d,
                                         seed=seed)
    cache = paged_cpu.kv_cache.permute(0, 2, 1, 3).contiguous().to(device, dtype).permute(0, 2, 1, 3)
    cam.block_table_tensor = cam.block_table_tensor.to(device)
    cam.seq_lens = cam.seq_lens.to(device)
    return PagedKV(cache, "flash", d), cam, q.to(device, dtype)


def refresh_stacks(configs, hq, hkv, d, dtype, device, layers):
    """One controller per config (dicts), each with ``layers`` GPU-path layers (double-buffered)."""
    from sfi_vllm.backends.packed_layer import PackedSFILayer
    from sfi_vllm.compact import PackedCompactBuffer
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController
    from test_sfi_layer import fake_vllm_config

    ctls, stacks = [], []
    for over in configs:
        ctl = SFIController(build_config(over, use_env=False), fake_vllm_config(over, max_model_len=8192))
        cap = ctl.cfg.compact_capacity(8192)
        stacks.append([PackedSFILayer(ctl, hq, hkv, d, scale=d ** -0.5,
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
