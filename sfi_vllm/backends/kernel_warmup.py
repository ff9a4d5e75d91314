"""Compile, at start-up, the Triton kernels that SFI's eager steps launch, so that serving does not.

Triton compiles a kernel the first time it meets a new set of compile-time constants (and of
integer and pointer specialisations: an integer equal to 1 or a multiple of 16, a pointer 16-byte
aligned), which takes about a second with the host blocked. With FULL CUDA graphs (vLLM's default
on the GPU) the capture at start-up compiles what decode-only steps use. Steps that carry a
prefill chunk run eagerly, and there the constants follow the batch: the fast-step kernel's split
count (:func:`~sfi_vllm.kernels.fast_decode.default_num_splits`, a power of two up to 64) and the
Selector's statistics splits (``S_PAD``, the next power of two of
:func:`~sfi_vllm.kernels.selector_scores.stat_splits`). On the H200 a serving benchmark logged 19
compilations after start-up, 10 of them in its timed pass, each a pause of 0.5-1.5 s felt by every
running request (``benchmarks/results/serve-bench-qwen-h200.md``).

:func:`warm_up_eager_kernels` launches each such configuration once on a few tokens: the fast-step
kernel and its merge at every eager split count, the slow-step score kernel, the Selector's kernels
at every statistics pad with the engine's Selector settings, the page top-K at every tile of best
pages up to the engine's budget, and both repack kernels. It reads the layer's real KV cache (block
0, through its own block table) and writes only buffers of its own. What else made variants is kept
from varying: integer arguments that change with the batch (row strides, selection sizes, split
counts) are ``do_not_specialize`` in the kernels, and the per-step host tables whose rows the
kernels take as pointers are laid out with every row 16-byte aligned
(:func:`sfi_vllm.host_copy.rows_to_device`).

Not covered: Selector settings that a request changes (its own ``selector`` fields are compile-time
constants, and a budget above the engine's can need a wider page top-K tile; the first such request
compiles them), other page sizes or dtypes than the first SFI layer's, and the uniform launch's
split counts when it runs without FULL graphs (``--enforce-eager``, or a drafter pass in piecewise
graphs): each new batch size compiles there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("sfi_vllm")

# the fast-step kernel's split counts on the eager path: default_num_splits rounds down to a power
# of two and caps at 64
EAGER_SPLITS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LayerGeometry:
    """What a layer's kernels are compiled for."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


def selector_split_counts(max_splits: int | None = None) -> tuple[int, ...]:
    """Statistics split counts whose pads (``max(2, next_power_of_two(n))``) cover every pad that
    :func:`~sfi_vllm.kernels.selector_scores.stat_splits` can give."""
    from sfi_vllm.kernels.selector_scores import MAX_SPLITS

    top = MAX_SPLITS if max_splits is None else max_splits
    out, n = [], 2
    while n <= top:
        out.append(n)
        n *= 2
    return tuple(out)


def warm_up_eager_kernels(geometry: LayerGeometry, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          cfg, splits: tuple[int, ...] = EAGER_SPLITS,
                          selector_splits: tuple[int, ...] | None = None) -> tuple[list[str], list[str]]:
    """Launch each eager configuration once (module doc). ``key_cache`` / ``value_cache``: one
    layer's ``(num_blocks, page, Hkv, D)`` views (read: block 0 only); ``cfg``: the engine's
    :class:`~sfi_vllm.config.SFIConfig`. Returns ``(launched, failed)``, one entry per
    configuration; a configuration that fails (its exception in the entry) does not stop the
    others."""
    from sfi_vllm.backends.selection import WIDTH_BUCKET
    from sfi_vllm.host_copy import rows_to_device
    from sfi_vllm.kernels.fast_decode import fast_decode_attention
    from sfi_vllm.kernels.repack import repack, repack_selected
    from sfi_vllm.kernels.selector_scores import selector_scores
    from sfi_vllm.kernels.slow_scores import slow_step_scores

    hq, hkv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_size
    g = hq // hkv
    dev, dtype = key_cache.device, key_cache.dtype
    page = key_cache.shape[1]
    i32 = dict(dtype=torch.int32, device=dev)
    done: list[str] = []
    failed: list[str] = []

    def launch(name: str, run) -> None:
        try:
            run()
        except Exception as e:  # the others still run; the caller reports the failures
            failed.append(f"{name}: {type(e).__name__}: {e}")
        else:
            done.append(name)

    # the fast-step kernel, one row of 16 tokens, at every eager split count
    q = torch.randn(1, hq, d, dtype=dtype, device=dev)
    compact = torch.zeros(1, hkv, page, d, dtype=dtype, device=dev)
    block_table = torch.zeros(1, 1, **i32)
    zero = torch.zeros(1, **i32)
    seq = torch.full((1,), page, **i32)
    for n in splits:
        launch(f"fast_decode splits={n}", lambda n=n: fast_decode_attention(
            q, compact, compact, key_cache, value_cache, block_table, zero, zero, seq, zero, zero,
            geometry.scale, n, slot_map=zero))

    # the slow-step scores over one frame
    launch("slow_scores", lambda: slow_step_scores(q, key_cache, block_table, seq, WIDTH_BUCKET, geometry.scale))

    # the Selector at every statistics pad: a frame wide enough for n splits, and target_programs
    # set so that stat_splits gives n
    lo = cfg.sinks
    fused_selector = cfg.selector.smooth_kernel <= 1  # else the torch Selector serves (no kernels)
    for n in (selector_splits if selector_splits is not None else selector_split_counts()) if fused_selector else ():
        frame = -(-(n * 1024 + lo) // WIDTH_BUCKET) * WIDTH_BUCKET
        lg = torch.randn(1, hkv, g, frame, dtype=torch.float32, device=dev)
        nm = torch.ones(1, hkv, frame, dtype=torch.float32, device=dev)
        count = torch.full((1,), float(frame - lo), dtype=torch.float32, device=dev)
        launch(f"selector_scores splits={n}", lambda lg=lg, nm=nm, count=count, n=n: selector_scores(
            cfg.selector, lg, nm, lo, count, target_programs=n * hkv))

    # the page top-K (page selection, unless selector_top_k is torch): one variant per tile of best
    # pages up to the engine's budget (a request's larger K compiles its own)
    page_sel = cfg.selector.page_size
    from sfi_vllm.kernels.top_k_pages import supports

    if fused_selector and supports(page_sel) and cfg.experimental.selector_top_k != "torch":
        from sfi_vllm.kernels.top_k_pages import MIN_PAGE_TILE, top_k_pages
        from sfi_vllm.selector import PageScores

        budget = cfg.selected_tokens if cfg.selected_tokens is not None else cfg.selected_cap
        tile = MIN_PAGE_TILE
        while True:
            kmax = page_sel * (tile - 1)  # ceil(kmax / page) + 1 == tile pages
            width = -(-(tile * page_sel) // WIDTH_BUCKET) * WIDTH_BUCKET
            scores = PageScores(torch.randn(1, hkv, width // page_sel, dtype=torch.float32, device=dev),
                                torch.randn(1, hkv, width, dtype=torch.float32, device=dev), page_sel)
            budgets = torch.full((1,), kmax, dtype=torch.long, device=dev)
            launch(f"top_k_pages tile={tile}", lambda scores=scores, budgets=budgets, kmax=kmax: top_k_pages(
                scores, lo, budgets, kmax))
            if -(-budget // page_sel) + 1 <= tile:
                break
            tile *= 2

    # the repacks of sinks + a selection into a set of their own: the per-step refresh's (int64
    # positions from the top-K, with the publish, as it always runs) and the per-layer path's
    k = page
    selected = torch.arange(lo, lo + k, dtype=torch.long, device=dev).expand(1, hkv, k).contiguous()
    meta = rows_to_device([[0], [lo + k], [0], [0]], dev)
    out_k = torch.empty(1, hkv, lo + k, d, dtype=dtype, device=dev)
    out_v = torch.empty_like(out_k)
    length, window, slot_map = torch.zeros(1, **i32), torch.zeros(1, **i32), torch.zeros(1, **i32)
    table = torch.zeros(1, -(-(lo + k) // page), **i32)
    launch("repack_selected", lambda: repack_selected(key_cache, value_cache, table, selected, lo, meta, out_k,
                                                       out_v, length, window, slot_map))
    positions = torch.cat([torch.arange(lo, **i32).expand(1, hkv, lo), selected.to(torch.int32)], dim=2).contiguous()
    launch("repack", lambda: repack(key_cache, value_cache, table, meta[0], positions, meta[1], out_k, out_v))
    return done, failed


def warm_up_layer(impl, kv_cache: torch.Tensor, cfg) -> tuple[list[str], list[str], float]:
    """:func:`warm_up_eager_kernels` for one SFI attention layer (``impl``: its
    :class:`~sfi_vllm.backends.cuda.SFIFlashImpl`) and its bound KV cache; the device synchronised
    before the time is taken. Returns (launched, failed, seconds)."""
    t0 = time.perf_counter()
    key_cache, value_cache = impl._paged(kv_cache).nhd_views()
    geometry = LayerGeometry(impl.num_heads, impl.num_kv_heads, impl.head_size, float(impl.scale))
    done, failed = warm_up_eager_kernels(geometry, key_cache, value_cache, cfg)
    if key_cache.is_cuda:
        torch.cuda.synchronize(key_cache.device)
    return done, failed, time.perf_counter() - t0
