"""The per-request statistics registry and its stats file."""

import json

import numpy as np

from sfi_vllm.stats import StatsRegistry
from sfi_vllm.trigger import SlowReason, StepMode


def _run(reg, req_id, fast):
    reg.record_step(req_id, int(StepMode.PREFILL), 0, 100)
    reg.record_step(req_id, int(StepMode.SLOW), int(SlowReason.FIRST_DECODE), 101)
    for i in range(fast):
        reg.record_step(req_id, int(StepMode.FAST), 0, 102 + i)


def test_open_requests_are_written_at_exit_and_only_once(tmp_path):
    f = tmp_path / "stats.jsonl"
    reg = StatsRegistry(str(f))
    _run(reg, "a", 3)
    _run(reg, "b", 5)
    reg.finish("a")  # retired by a scheduler output
    assert [json.loads(x)["req_id"] for x in f.read_text().splitlines()] == ["a"]
    assert reg.write_open_requests() == 1  # what atexit runs: "b" never retired
    assert reg.write_open_requests() == 0
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    assert [(r["req_id"], r["retired"], r["fast_steps"], r["slow_steps"]) for r in recs] == [
        ("a", True, 3, 1), ("b", False, 5, 1)]
    reg.finish("b")  # a late retirement of a request already written does not write it twice
    assert len(f.read_text().splitlines()) == 2


def test_no_file_no_writes(tmp_path):
    reg = StatsRegistry(None)
    _run(reg, "a", 2)
    assert reg.write_open_requests() == 0
    assert reg.lookup("a") is None  # forgotten once the process is done with it


def test_a_stats_file_that_cannot_be_written_stops_the_start_not_the_serving(tmp_path, caplog):
    """A path in a missing directory is refused when the registry is made (at engine start-up);
    a file whose directory goes away while serving is logged once, and requests go on."""
    import pytest

    from sfi_vllm.config import SFIConfigError

    with pytest.raises(SFIConfigError, match="sfi.stats_file: cannot append to"):
        StatsRegistry(str(tmp_path / "missing" / "stats.jsonl"))
    with pytest.raises(SFIConfigError, match="sfi.stats_file"):
        StatsRegistry(str(tmp_path))  # a directory
    folder = tmp_path / "gone"
    folder.mkdir()
    reg = StatsRegistry(str(folder / "stats.jsonl"))
    (folder / "stats.jsonl").unlink()
    folder.rmdir()
    _run(reg, "a", 1)
    _run(reg, "b", 1)
    _run(reg, "c", 1)
    with caplog.at_level("ERROR", logger="sfi_vllm"):
        reg.finish("a")  # raised OSError into the engine step before
        reg.finish("b")
        reg._write_open_at_exit()  # "c", at exit
    assert caplog.text.count("could not append request statistics") == 1
    assert reg.lookup("a").fast_steps == 1  # still kept in memory
    folder.mkdir()  # the folder is back: writing resumes
    _run(reg, "d", 2)
    reg.finish("d")
    assert [json.loads(x)["req_id"] for x in (folder / "stats.jsonl").read_text().splitlines()] == ["d"]


class _FakeCounter:
    def __init__(self):
        self.values = {}

    def labels(self, **labels):
        key = tuple(sorted(labels.items()))
        counter = self

        class _Child:
            def inc(self, n=1):
                counter.values[key] = counter.values.get(key, 0) + n

        return _Child()


def test_graph_runs_reach_the_metric_as_what_each_count_grew_by():
    from types import SimpleNamespace

    metrics = SimpleNamespace(graph_runs=_FakeCounter())
    reg = StatsRegistry(metrics=metrics)
    reg.note_graph_runs("selection", {"replay": 0, "capture": 1, "eager": 3})
    reg.note_graph_runs("selection", {"replay": 5, "capture": 1, "eager": 4})
    reg.note_graph_runs("drafter", {"replay": 2, "capture": 1, "eager": 1})
    got = metrics.graph_runs.values
    assert got[(("how", "replay"), ("what", "selection"))] == 5
    assert got[(("how", "capture"), ("what", "selection"))] == 1
    assert got[(("how", "eager"), ("what", "selection"))] == 4
    assert got[(("how", "replay"), ("what", "drafter"))] == 2
    # a count that does not grow adds nothing; without metrics nothing is written
    reg.note_graph_runs("selection", {"replay": 5, "capture": 1, "eager": 4})
    assert got[(("how", "replay"), ("what", "selection"))] == 5
    StatsRegistry().note_graph_runs("selection", {"replay": 1})


def test_fallbacks_count_once_per_request_under_a_known_reason(caplog):
    """Fallback reasons are the metrics' label values, listed at 0 from the start
    (``SFIMetrics``): a reason outside ``FALLBACK_REASONS`` would be a series no one expects."""
    import logging
    from types import SimpleNamespace

    from sfi_vllm.stats import FALLBACK_REASONS

    fallbacks = _FakeCounter()
    reg = StatsRegistry(metrics=SimpleNamespace(fallbacks=fallbacks))
    for reason in FALLBACK_REASONS:
        reg.note_fallback(f"r-{reason}", reason)
        reg.note_fallback(f"r-{reason}", reason)  # the same request again, after a preemption
    assert fallbacks.values == {(("reason", r),): 1 for r in FALLBACK_REASONS}
    with caplog.at_level(logging.ERROR, logger="sfi_vllm"):
        reg.note_fallback("r", "pool_full")  # a caller's bug: said, counted, and the worker goes on
    assert "fallback reason 'pool_full' is not one of config_error, compact_pool_full" in caplog.text
    assert fallbacks.values[(("reason", "pool_full"),)] == 1


def test_the_executor_counts_both_refresh_paths_together():
    from sfi_vllm.backends.cuda_executor import CudaExecutor
    from sfi_vllm.config import build_config

    ex = CudaExecutor(build_config({}, use_env=False))
    ex.step_refresh.replays, ex.step_refresh.captures, ex.step_refresh.eager_runs = 7, 1, 2
    ex.slow_selection.replays, ex.slow_selection.captures, ex.slow_selection.eager_runs = 3, 2, 5
    assert ex.graph_runs() == {"replay": 10, "capture": 3, "eager": 7}


def test_prompt_tokens_is_the_prompts_length_whatever_the_prefill_chunks():
    """A prompt prefilled in chunks (a request aborted after its first chunk, say) and a request
    that recomputes its prompt and output after a preemption both record the prompt's length."""
    import numpy as np
    import torch

    from test_policies import controller

    ctl = controller()
    ctl.plan_step(["chunked"], np.array([256]), np.array([0]), [1000], torch.tensor([3]))
    ctl.end_step()
    assert ctl.stats.get("chunked").prompt_tokens == 1000
    ctl.plan_step(["resumed"], np.array([1100]), np.array([0]), [1000], torch.tensor([3]))
    ctl.end_step()
    st = ctl.stats.get("resumed")
    assert st.prompt_tokens == 1000 and st.prefill_steps == 1


def test_docs_name_every_field_of_a_stats_line():
    """docs/serving.md's table of the stats file's fields names each field a line has."""
    from pathlib import Path

    from sfi_vllm.stats import RequestStats

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    fields = [*RequestStats("r").to_dict(), "retired"]
    missing = [f for f in fields if f"`{f}`" not in docs]
    assert not missing, f"docs/serving.md does not describe the stats file's {missing}"


def test_finished_requests_kept_are_bounded_by_their_slow_step_events(monkeypatch):
    """A server reads no finished statistics, and one request may record MAX_EVENTS slow-step
    events: the kept ones are bounded by their events too, newest kept, the counts exact."""
    import sfi_vllm.stats as stats

    monkeypatch.setattr(stats, "KEEP_FINISHED_EVENTS", 25)
    reg = StatsRegistry(None)
    for i in range(6):
        rid = f"r{i}"
        reg.record_step(rid, int(StepMode.PREFILL), 0, 100)
        for j in range(10):  # 10 slow steps each
            reg.record_step(rid, int(StepMode.SLOW), int(SlowReason.REUSE_BUDGET), 101 + j)
        reg.finish(rid)
    kept = reg.snapshot()
    assert sorted(kept) == ["r4", "r5"]  # 20 events; a third request would make 30
    assert reg._finished_events == 20 and all(len(st.slow_events) == 10 for st in kept.values())
    big = "big"  # a request over the bound on its own is still kept, alone
    for j in range(40):
        reg.record_step(big, int(StepMode.SLOW), int(SlowReason.REUSE_BUDGET), 200 + j)
    reg.finish(big)
    assert list(reg.snapshot()) == ["big"] and reg.lookup("big").slow_steps == 40


def test_a_record_names_the_callers_request_id(tmp_path):
    f = tmp_path / "stats.jsonl"
    reg = StatsRegistry(str(f))
    _run(reg, "chatcmpl-7f3a-0a1b2c3d", 2)  # vLLM's internal id: the caller's and -<8 hex>
    reg.finish("chatcmpl-7f3a-0a1b2c3d")
    rec = json.loads(f.read_text())
    assert (rec["req_id"], rec["request_id"]) == ("chatcmpl-7f3a-0a1b2c3d", "chatcmpl-7f3a")


def _open_request_in_child(path):
    reg = StatsRegistry(path)
    _run(reg, "open", 2)  # never retired: the process ends while it runs


def test_a_forked_worker_writes_its_open_requests_when_it_exits(tmp_path):
    # vLLM forks its workers by default; a forked process leaves through os._exit, which skips
    # atexit handlers but runs multiprocessing's finalizers
    import multiprocessing

    f = tmp_path / "stats.jsonl"
    child = multiprocessing.get_context("fork").Process(target=_open_request_in_child, args=(str(f),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    assert [(r["req_id"], r["retired"], r["fast_steps"]) for r in recs] == [("open", False, 2)]


def test_the_callers_id_is_kept_whole_where_vllm_adds_no_suffix(monkeypatch):
    from sfi_vllm.stats import external_request_id

    assert external_request_id("batch-7-0a1b2c3d") == "batch-7"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")  # vLLM then uses the caller's id as is
    assert external_request_id("batch-7-0a1b2c3d") == "batch-7-0a1b2c3d"


def test_the_speed_benchmark_counts_requests_that_ran_densely(monkeypatch):
    """benchmarks/e2e_bench.py flags a row whose requests fell back to dense attention (a full
    compact-set pool): their steps were dense, so the row would not measure SFI."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import sfi_vllm.controller as controller

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import e2e_bench

    def req(fallback):
        d = dict(slow_steps=1, decode_steps=9, fast_attended_tokens=5, fast_context_tokens=50, dense_steps=0,
                 fallback=fallback)
        return SimpleNamespace(to_dict=lambda: d)

    snapshot = {"a": req(None), "b": req("compact_pool_full"), "c": req("config_error")}
    ctl = SimpleNamespace(stats=SimpleNamespace(snapshot=lambda: snapshot))
    monkeypatch.setattr(controller, "current_controller", lambda: ctl)
    totals = e2e_bench._stats_totals(llm=None)
    assert totals[:2] == (3, 27) and totals[7] == 2


def test_a_steps_rows_recorded_at_once_equal_rows_recorded_one_by_one():
    rng = np.random.default_rng(0)
    kinds = [(StepMode.PREFILL, SlowReason.NONE), (StepMode.DENSE, SlowReason.NONE),
             (StepMode.FAST, SlowReason.NONE), (StepMode.SLOW, SlowReason.FIRST_DECODE),
             (StepMode.SLOW, SlowReason.REUSE_BUDGET), (StepMode.SLOW, SlowReason.BOUNDARY)]
    one, batched = StatsRegistry(), StatsRegistry()
    for _ in range(40):  # steps of 6 rows drawn from 8 requests (a request may be new)
        rows = rng.choice(8, 6, replace=False)
        picks = [kinds[k] for k in rng.integers(0, len(kinds), 6)]
        ids = [f"req{r}" for r in rows]
        modes, reasons = [int(m) for m, _ in picks], [int(r) for _, r in picks]
        contexts = [int(c) for c in rng.integers(100, 9000, 6)]
        prompts = [int(p) for p in rng.integers(50, 100, 6)]
        for args in zip(ids, modes, reasons, contexts, prompts):
            one.record_step(*args)
        batched.record_steps(ids, modes, reasons, contexts, prompts)
    assert batched._steps == one._steps and sum(one._steps.values()) == 240
    assert {k: v.to_dict() for k, v in batched.active.items()} == {k: v.to_dict() for k, v in one.active.items()}
