"""``sfi.drafter_graphs``: the decision to run the drafter's later passes as full CUDA
graphs, the padded tables the builder makes for them, and the wrapper's fallbacks. The capture
and replay themselves need CUDA (on the CPU a capture fails, which exercises the fallback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController
from tests.test_sfi_layer import fake_vllm_config

LOSSLESS = {"mode": "lossless", "sinks": 4, "recent_window": 16, "selected_tokens": 16,
            "drafter_graphs": True}


def _controller(over=LOSSLESS):
    return SFIController(build_config({**over, "boundary_token_ids": [7]}), fake_vllm_config(over, max_model_len=8192))


def test_the_later_passes_run_full_graphs_and_the_first_pass_only_with_its_tables():
    from vllm.config import CUDAGraphMode

    from sfi_vllm.patches.drafter_graphs import DrafterGraphs, decide

    ctl = _controller()
    model = object()
    proposer = SimpleNamespace(model=model, _sfi_decisions=0, method="draft_model")
    pw = CUDAGraphMode.PIECEWISE
    assert decide(proposer, ctl, pw, 24, None) == (pw, 24, None)  # the first pass: its build made no tables
    assert decide(proposer, ctl, pw, 8, None) == (CUDAGraphMode.FULL, 8, None)  # the later passes
    assert isinstance(proposer.model, DrafterGraphs) and proposer.model.runnable is model
    assert ctl.draft_graph_rows == 8
    # outside propose (vLLM's own dummy runs), without graphs, with data parallelism, or switched off
    def later(**kw):  # a proposer at its second decision
        return SimpleNamespace(**{"model": model, "_sfi_decisions": 1, "method": "draft_model", **kw})

    assert decide(later(), ctl, pw, 8, None)[0] == CUDAGraphMode.FULL
    # outside propose (vLLM's own dummy runs), without graphs, with data parallelism, another
    # method, tensor parallelism, or switched off
    assert decide(later(_sfi_decisions=None), ctl, pw, 8, None)[0] == pw
    assert decide(later(), ctl, CUDAGraphMode.NONE, 8, None)[0] == CUDAGraphMode.NONE
    assert decide(later(), ctl, pw, 8, torch.tensor([8, 8]))[0] == pw
    assert decide(later(method="eagle3"), ctl, pw, 8, None)[0] == pw
    tp2 = _controller()
    tp2.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    assert decide(later(), tp2, pw, 8, None)[0] == pw
    off = _controller({**LOSSLESS, "drafter_graphs": False})
    assert decide(later(), off, pw, 8, None)[0] == pw


def test_a_one_token_first_pass_asks_vllms_padding_and_then_runs_its_graph():
    """vLLM builds the first pass's metadata before it decides how to run it: the build asks the
    proposer's dispatcher for the padding (one token per row only), and the decision is full when
    the build made the graph's tables for that many rows."""
    from vllm.config import CUDAGraphMode

    from sfi_vllm.patches.drafter_graphs import DrafterGraphs, decide, first_pass_graph_rows

    pw, full = CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
    ctl = _controller()
    modes = {"mode": pw}
    dispatcher = SimpleNamespace(dispatch=lambda n: (modes["mode"], SimpleNamespace(num_tokens=-(-n // 5) * 5)))
    proposer = SimpleNamespace(model=object(), _sfi_decisions=0, method="draft_model", cudagraph_dispatcher=dispatcher)
    one = SimpleNamespace(max_query_len=1, num_actual_tokens=8, num_reqs=8)
    outside = SimpleNamespace(**{**vars(proposer), "_sfi_decisions": None})
    assert first_pass_graph_rows(ctl, outside, one) is None  # outside a propose call
    assert first_pass_graph_rows(ctl, proposer, one) == 10
    several = SimpleNamespace(max_query_len=3, num_actual_tokens=20, num_reqs=8)  # vLLM's layout
    assert first_pass_graph_rows(ctl, proposer, several) is None
    modes["mode"] = CUDAGraphMode.NONE  # vLLM runs no graph for this size
    assert first_pass_graph_rows(ctl, proposer, one) is None
    modes["mode"] = pw
    # the build made no tables (an eager pass), or tables for another size: piecewise
    assert decide(proposer, ctl, pw, 10, None)[0] == pw
    proposer._sfi_decisions = 0
    ctl.draft_graph = (5, (1, 2, 3))
    assert decide(proposer, ctl, pw, 10, None)[0] == pw
    proposer._sfi_decisions = 0
    ctl.draft_graph = (10, (1, 2, 3))
    assert decide(proposer, ctl, pw, 10, None) == (full, 10, None)
    assert isinstance(proposer.model, DrafterGraphs) and ctl.draft_graph_rows is None
    assert first_pass_graph_rows(ctl, proposer, one) is None  # past the first decision
    # then the later passes' decision, as before
    assert decide(proposer, ctl, pw, 10, None)[0] == full and ctl.draft_graph_rows == 10
    off = _controller({**LOSSLESS, "drafter_graphs": False})
    assert first_pass_graph_rows(off, SimpleNamespace(**{**vars(proposer), "_sfi_decisions": 0}), one) is None


def _builder(ctl, rows=8):
    from sfi_vllm.backends.cuda import SFIFlashMetadataBuilder

    b = object.__new__(SFIFlashMetadataBuilder)
    b.controller = ctl
    b._row_tables = torch.full((2, rows), 5, dtype=torch.int32)
    b._graph_seq_lens = torch.full((rows,), 7, dtype=torch.int32)
    return b


def test_padded_tables_have_empty_padding_rows_at_fixed_addresses():
    from sfi_vllm.backends.common import FastRows

    ctl = _controller()
    b = _builder(ctl)
    storage = torch.arange(8 * 4, dtype=torch.int32).view(8, 4)  # the runner's block table, 8 rows
    cam = SimpleNamespace(num_reqs=3, seq_lens=torch.tensor([100, 200, 300], dtype=torch.int32),
                          block_table_tensor=storage[:3])
    tables = FastRows(rows=3, slot=b._row_tables[0], min_window_start=b._row_tables[1],
                      seq_lens=cam.seq_lens, block_table=cam.block_table_tensor)
    out = b._graph_tables(tables, cam, 6)
    assert out.rows == 6 and out.seq_lens.data_ptr() == b._graph_seq_lens.data_ptr()
    assert out.seq_lens[:6].tolist() == [100, 200, 300, 0, 0, 0]
    assert b._row_tables[0, 3:6].tolist() == [-1] * 3 and b._row_tables[1, 3:6].tolist() == [0] * 3
    assert b._row_tables[0, :3].tolist() == [5] * 3  # the real rows' tables are uniform_tables'
    assert torch.equal(out.block_table, storage[:6])
    assert ctl.draft_graph == (6, (b._graph_seq_lens.data_ptr(), storage.data_ptr(), b._row_tables.data_ptr()))
    # more rows than the row tables hold: the tables stay as they were, no graph
    ctl.draft_graph = None
    assert b._graph_tables(tables, cam, 9) is tables and ctl.draft_graph is None


def test_a_padded_batch_past_vllms_block_table_reads_a_copy_of_its_own():
    """8 rows of vLLM's block table (max_num_seqs 8), a drafter batch padded to 10 rows: the graph
    reads the builder's own table, the real rows copied and the padding rows zero, at an address
    that stays while the size does."""
    from sfi_vllm.backends.common import FastRows

    ctl = _controller()
    b = _builder(ctl, rows=12)
    b._graph_block_table = None
    storage = torch.arange(8 * 4, dtype=torch.int32).view(8, 4) + 1
    cam = SimpleNamespace(num_reqs=8, seq_lens=torch.arange(1, 9, dtype=torch.int32) * 100, block_table_tensor=storage)
    tables = FastRows(rows=8, slot=b._row_tables[0], min_window_start=b._row_tables[1],
                      seq_lens=cam.seq_lens, block_table=storage)
    out = b._graph_tables(tables, cam, 10)
    assert out.rows == 10 and out.block_table.shape == (10, 4)
    assert torch.equal(out.block_table[:8], storage) and not out.block_table[8:].any()
    assert out.seq_lens[8:10].tolist() == [0, 0]
    address = out.block_table.data_ptr()
    assert address != storage.data_ptr() and ctl.draft_graph[1][1] == address
    storage += 100  # the next step's tables: copied again, same address
    out = b._graph_tables(tables, cam, 10)
    assert out.block_table.data_ptr() == address and torch.equal(out.block_table[:8], storage)


def test_the_wrapper_warms_each_size_piecewise_then_falls_back_when_capture_fails(monkeypatch):
    from vllm.config import CUDAGraphMode

    from sfi_vllm.patches import drafter_graphs as dg

    ctl = _controller()
    calls = []

    def model(input_ids=None, positions=None):
        calls.append(get_mode())
        return input_ids

    fc = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=SimpleNamespace(num_tokens=4))
    get_mode = lambda: fc.cudagraph_runtime_mode  # noqa: E731
    monkeypatch.setattr("vllm.forward_context.is_forward_context_available", lambda: True)
    monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: fc)
    wrapper = dg.DrafterGraphs(model, ctl)
    assert ctl.drafter_graph_wrapper is wrapper  # metrics and benchmarks read its counters there
    ids = torch.zeros(4, dtype=torch.long)
    # no graph-ready tables for this pass: piecewise
    wrapper(input_ids=ids)
    assert calls[-1] == CUDAGraphMode.PIECEWISE and wrapper.piecewise == 1
    # ready: the first call of the size runs piecewise (its kernels compile outside a capture)
    ctl.draft_graph = (4, (1, 2, 3))
    fc.cudagraph_runtime_mode = CUDAGraphMode.FULL
    wrapper(input_ids=ids)
    assert calls[-1] == CUDAGraphMode.PIECEWISE and 4 in wrapper.warmed
    # the next one captures; without CUDA the capture fails and the size stays piecewise
    fc.cudagraph_runtime_mode = CUDAGraphMode.FULL
    if not torch.cuda.is_available():
        wrapper(input_ids=ids)
        assert 4 in wrapper.failed and wrapper.captures == 0 and calls[-1] == CUDAGraphMode.PIECEWISE
    # any other mode passes through untouched
    fc.cudagraph_runtime_mode = CUDAGraphMode.NONE
    wrapper(input_ids=ids)
    assert calls[-1] == CUDAGraphMode.NONE
    if not torch.cuda.is_available():
        assert wrapper.counters() == dict(replay=0, capture=0, eager=3)
        # the step's end publishes them (sfi_cuda_graph_runs{what="drafter"})
        seen = []
        ctl.stats.note_graph_runs = lambda what, totals: seen.append((what, totals))
        ctl.end_step()
        assert ("drafter", dict(replay=0, capture=0, eager=3)) in seen


def test_on_by_default_in_lossless_and_the_old_key_names_its_new_place():
    from sfi_vllm.config import SFIConfigError

    assert build_config({"mode": "lossless"}, use_env=False).drafter_graphs is True
    with pytest.raises(SFIConfigError, match="experimental.drafter_graphs moved to sfi.drafter_graphs"):
        build_config({"experimental": {"drafter_graphs": True}}, use_env=False)


def test_a_parallel_engine_says_at_start_up_why_its_drafter_runs_piecewise():
    from sfi_vllm.patches import drafter_graphs as dg

    ctl = _controller()
    assert dg.not_served(ctl) is None
    ctl.vllm_config.parallel_config = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                                      data_parallel_size=1)
    assert "tensor or pipeline" in dg.not_served(ctl)
    ctl.vllm_config.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                      data_parallel_size=2)
    assert dg.not_served(ctl) == "data parallelism"
