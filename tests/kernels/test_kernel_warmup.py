"""The start-up compilation of the eager path's kernels (``sfi_vllm.backends.kernel_warmup``): it
launches every compile-time configuration that the eager path's batch-dependent choices can give,
and a failure is reported, not swallowed."""

from __future__ import annotations

import logging

import pytest
import torch

from builders import GPU_DTYPES, case, paged_cache

# these tests check the tiles of best pages a GPU compiles: the interpreter cases keep the page
# top-K's smallest tile at its real value (tests/kernels/conftest.py)
KEEPS_GPU_PAGE_TILES = True


class Recorder:
    """Wraps a ``@triton.jit`` kernel: records each launch's keyword arguments (the constants),
    then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def run_warmup(device, dtype, monkeypatch, hq=4, hkv=2, d=32, page=16, sfi=None):
    import sfi_vllm.kernels.fast_decode as fast_decode
    import sfi_vllm.kernels.repack as repack
    import sfi_vllm.kernels.selector_scores as selector_scores
    import sfi_vllm.kernels.slow_scores as slow_scores
    import sfi_vllm.kernels.top_k_pages as top_k_pages
    from sfi_vllm.backends.kernel_warmup import LayerGeometry, warm_up_eager_kernels
    from sfi_vllm.config import build_config

    rec = {}
    for module, name in ((fast_decode, "_fast_decode_split"), (fast_decode, "_merge_splits"),
                         (slow_scores, "_slow_scores"), (selector_scores, "_stats_total"),
                         (selector_scores, "_stats_finish"), (repack, "_repack_selected"), (repack, "_repack"),
                         (top_k_pages, "_top_k_pages")):
        rec[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, rec[name])
    _, kc, vc = paged_cache(3, page, hkv, d, dtype, device, torch.Generator().manual_seed(0))
    done, failed = warm_up_eager_kernels(LayerGeometry(hq, hkv, d, d ** -0.5), kc, vc,
                                         build_config(sfi or {}, use_env=False), **({"selector_splits": (2,)} if sfi else {}))
    assert failed == []
    return done, rec


@pytest.mark.parametrize("device,dtype", [
    case("cpu", torch.float32, id="float32"),
    *(case("cuda", dt, id=str(dt).split(".")[-1]) for dt in GPU_DTYPES),
])
def test_warmup_launches_every_eager_configuration(device, dtype, monkeypatch):
    from sfi_vllm.backends.kernel_warmup import EAGER_SPLITS, selector_split_counts
    from sfi_vllm.config import build_config

    done, rec = run_warmup(device, dtype, monkeypatch)
    assert {k["NUM_SPLITS"] for k in rec["_fast_decode_split"].launches} == set(EAGER_SPLITS)
    assert {k["S_PAD"] for k in rec["_merge_splits"].launches} == {max(2, n) for n in EAGER_SPLITS}
    assert len(rec["_slow_scores"].launches) == 1
    pads = {max(2, n) for n in selector_split_counts()}
    assert {k["S_PAD"] for k in rec["_stats_total"].launches} == pads
    assert {k["S_PAD"] for k in rec["_stats_finish"].launches} == pads
    assert {k["PUBLISH"] for k in rec["_repack_selected"].launches} == {True}  # the refresh always publishes
    assert len(rec["_repack"].launches) == 1
    # the default budget (2048 tokens: 129 pages of 16) fits the smallest tile of best pages
    page_kernel = build_config({}, use_env=False).experimental.selector_top_k != "torch"
    assert [k["KP_PAD"] for k in rec["_top_k_pages"].launches] == ([256] if page_kernel else [])
    assert len(done) == len(EAGER_SPLITS) + 1 + len(pads) + page_kernel + 2


@pytest.mark.parametrize("device", [case("cpu", id="float32")])
def test_a_failing_configuration_does_not_stop_the_others(device, monkeypatch):
    import sfi_vllm.kernels.fast_decode as fast_decode
    from sfi_vllm.backends.kernel_warmup import EAGER_SPLITS, LayerGeometry, warm_up_eager_kernels
    from sfi_vllm.config import build_config

    real = fast_decode.fast_decode_attention

    def flaky(*args, **kwargs):
        if args[12] == 4:
            raise RuntimeError("out of resources")
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_decode, "fast_decode_attention", flaky)
    _, kc, vc = paged_cache(3, 16, 2, 32, torch.float32, device, torch.Generator().manual_seed(0))
    done, failed = warm_up_eager_kernels(LayerGeometry(4, 2, 32, 32 ** -0.5), kc, vc, build_config({}, use_env=False),
                                         selector_splits=(2,))
    assert failed == ["fast_decode splits=4: RuntimeError: out of resources"]
    page_kernel = build_config({}, use_env=False).experimental.selector_top_k != "torch"
    assert len(done) == len(EAGER_SPLITS) - 1 + 1 + 1 + page_kernel + 2 and "repack" in done


@pytest.mark.parametrize("device", [case("cpu", id="float32")])
def test_warmup_compiles_the_page_top_k_up_to_the_engines_budget(device, monkeypatch):
    """A budget of 4,096 tokens (257 pages of 16) needs tiles of 256 and 512 best pages (shorter
    contexts take the smaller one; each doubling of the budget adds a tile); with
    ``selector_top_k: torch`` no page top-K kernel runs, so none is compiled."""
    _, rec = run_warmup(device, torch.float32, monkeypatch,
                        sfi={"selected_tokens": 4096, "experimental": {"selector_top_k": "auto"}})
    assert [k["KP_PAD"] for k in rec["_top_k_pages"].launches] == [256, 512]
    _, rec = run_warmup(device, torch.float32, monkeypatch, sfi={"experimental": {"selector_top_k": "torch"}})
    assert rec["_top_k_pages"].launches == []


def test_host_tables_have_every_row_16_byte_aligned():
    """The per-step tables whose rows the kernels take as pointers: one alignment class whatever
    the row count (Triton compiles a variant per class)."""
    from sfi_vllm.host_copy import rows_to_device

    for n in range(1, 10):
        rows = [[i * 10 + j for j in range(n)] for i in range(4)]
        t = rows_to_device(rows, "cpu")
        assert t.shape == (4, n) and t.tolist() == rows and t.stride(1) == 1
        assert all(t[i].data_ptr() % 16 == 0 for i in range(4))
    assert rows_to_device([[1, 2], [3, 4]], "cpu", torch.long)[1].data_ptr() % 16 == 0


def test_warmup_covers_what_the_eager_path_can_choose():
    """Every split count the eager fast step can take, and every statistics pad the Selector can
    take, is among those the warm-up launches (a change to either choice must update the warm-up)."""
    import triton

    from sfi_vllm.backends.kernel_warmup import EAGER_SPLITS, selector_split_counts
    from sfi_vllm.backends.selection import WIDTH_BUCKET
    from sfi_vllm.kernels.fast_decode import default_num_splits
    from sfi_vllm.kernels.selector_scores import stat_splits

    fast = {default_num_splits(rows, hkv, keys) for rows in range(1, 1025, 7) for hkv in (1, 2, 8, 32)
            for keys in (1, 255, 256, 5000, 40000, 1 << 20)}
    assert fast <= set(EAGER_SPLITS)
    pads = {max(2, triton.next_power_of_2(stat_splits(rows * hkv, WIDTH_BUCKET * m - sinks, 1024)))
            for rows in (1, 2, 3, 16, 100, 1000) for hkv in (1, 8) for m in (1, 2, 5, 64) for sinks in (0, 4)}
    assert pads <= {max(2, n) for n in selector_split_counts()}
    # the page top-K: every budget up to the default's and every frame share the smallest tile
    from sfi_vllm.kernels.top_k_pages import MIN_PAGE_TILE, page_tile

    assert {page_tile(k, 16, WIDTH_BUCKET * m // 16) for k in range(1, 2049, 17) for m in (1, 2, 64)} == {MIN_PAGE_TILE}


def test_failed_warmup_is_logged_and_startup_goes_on(monkeypatch, caplog):
    import sfi_vllm.backends.kernel_warmup as warmup
    import sfi_vllm.controller as controller
    from sfi_vllm.patches import kernel_warmup

    monkeypatch.setattr(controller, "current_controller", lambda: type("C", (), {"cfg": None})())
    monkeypatch.setattr(kernel_warmup, "sfi_kernel_layer", lambda cfg: ("impl", "kv"))

    def fail(impl, kv, cfg):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(warmup, "warm_up_layer", fail)
    with caplog.at_level(logging.WARNING, logger="sfi_vllm"):
        assert kernel_warmup.warm_up_worker(object()) is None
    assert "compiling the eager path's kernels at start-up failed (RuntimeError: no such kernel)" in caplog.text

    monkeypatch.setattr(warmup, "warm_up_layer", lambda impl, kv, cfg: (["a", "b"], ["c: ValueError: x"], 1.5))
    with caplog.at_level(logging.INFO, logger="sfi_vllm"):
        assert kernel_warmup.warm_up_worker(object()) == ["a", "b"]
    assert "(2 configurations, 1 failed, 1.5 s)" in caplog.text
    assert "compiling an eager-path kernel at start-up failed (c: ValueError: x)" in caplog.text


def test_no_kernel_layer_on_a_cpu_cache():
    """The warm-up finds no layer where the cache is not on a GPU (CPU engines, ``kernels: torch``)."""
    from sfi_vllm.patches.kernel_warmup import sfi_kernel_layer

    assert sfi_kernel_layer(None) is None
    ctx = type("CC", (), {"static_forward_context": {"l0": type("L", (), {"impl": object(), "kv_cache": [torch.zeros(4)]})()}})()
    assert sfi_kernel_layer(type("V", (), {"compilation_config": ctx})()) is None
