"""capture_graph keeps Python's cyclic collector off while a CUDA graph is being captured (a
collection that frees an unreachable CUDAGraph mid-capture invalidates the capture). The CUDA calls
are replaced by stand-ins that record whether the collector was on, so this runs on CPU."""

import contextlib
import gc

import pytest
import torch

from sfi_vllm.backends import selection


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def graph(g, capture_error_mode=None, pool=None):
        seen.append(("capture", gc.isenabled()) + (() if pool is None else (pool,)))
        yield

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return seen


def test_collector_is_off_during_capture_and_restored(fake_cuda):
    assert gc.isenabled()
    calls = []
    graph, out = selection.capture_graph(lambda: calls.append(gc.isenabled()) or len(calls))
    assert graph == "graph" and out == 2
    assert calls == [True, False]  # warm-up with the collector on, the captured run with it off
    assert fake_cuda == [("capture", False)]
    assert gc.isenabled()


def test_a_given_memory_pool_is_the_captures(fake_cuda):
    selection.capture_graph(lambda: None, pool="pool")
    assert fake_cuda == [("capture", False, "pool")]


def test_collector_restored_when_capture_fails(fake_cuda):
    def body():
        if not gc.isenabled():
            raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        selection.capture_graph(body)
    assert gc.isenabled()


def test_collector_left_off_when_it_was_off(fake_cuda):
    gc.disable()
    try:
        selection.capture_graph(lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_selection_captures_are_logged_first_one_by_one_then_sparsely(caplog):
    import logging

    from sfi_vllm.backends.selection import CAPTURE_LOG_EVERY, CAPTURE_LOG_FIRST, log_capture

    with caplog.at_level(logging.INFO, logger="sfi_vllm"):
        logged = [n for n in range(1, 3 * CAPTURE_LOG_EVERY + 1) if log_capture("a test's", n, 0.25, "2 slow rows")]
    assert logged == [*range(1, CAPTURE_LOG_FIRST + 1), *range(CAPTURE_LOG_EVERY, 3 * CAPTURE_LOG_EVERY + 1, CAPTURE_LOG_EVERY)]
    assert "captured a test's graph 1 (2 slow rows) in 250 ms" in caplog.text


def test_a_larger_scratch_drops_only_the_entries_that_read_the_old_one():
    """The per-step refresh's shared scratch (logits and norms of staged queries): when a larger
    one replaces it, the graphs holding the old one's address go; those whose scores the uniform
    launch wrote (fused) read their own buffers and stay captured."""
    from sfi_vllm.backends.step_refresh import StepRefresh, _Entry

    def entry(scratch: bool) -> _Entry:
        return _Entry(bt=None, seq=None, counts=None, budgets=None, meta=None, rows=None, logits=None,
                      norms=None, pointers=(), scratch=scratch)

    sr = StepRefresh()
    first = sr.scratch(100, "cpu")
    sr._entries["fused"], sr._entries["staged"] = entry(False), entry(True)
    assert sr.scratch(50, "cpu") is first and set(sr._entries) == {"fused", "staged"}
    larger = sr.scratch(200, "cpu")
    assert larger.numel() == 200 and larger is not first
    assert set(sr._entries) == {"fused"}


def test_a_gpu_scratch_is_allocated_at_its_largest_size_at_once():
    """Each growth of the shared scratch drops the graphs that read it, so on a GPU the first
    one takes what the largest chunk may (logits_bytes), and only a job that needs more (one
    layer's logits above it) grows it; on the CPU it is what is asked."""
    from sfi_vllm.backends.step_refresh import StepRefresh

    sr = StepRefresh(logits_bytes=4096)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert sr.scratch_numel(10, cuda) == 1024
    assert sr.scratch_numel(5000, cuda) == 5000
    assert sr.scratch_numel(10, cpu) == 10


def test_staged_jobs_pad_small_shapes_to_powers_of_two():
    """padded_shape: rows to a power of two, frames up to 16K too, while rows x frame stays within
    64K tokens; longer frames and larger products as they are."""
    from sfi_vllm.backends.step_refresh import padded_shape

    assert padded_shape(3, 6144) == (4, 8192)
    assert padded_shape(5, 8192) == (8, 8192)
    assert padded_shape(1, 10240) == (1, 16384)
    assert padded_shape(9, 8192) == (9, 8192)  # 16 x 8192 is over 64K tokens
    assert padded_shape(1, 34816) == (1, 34816)  # frames over 16K are not widened
    assert padded_shape(3, 20480) == (3, 20480)
    assert padded_shape(4, 4096) == (4, 4096)
