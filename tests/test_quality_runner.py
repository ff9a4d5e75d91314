"""The eval runner's bookkeeping without an engine: suite files, chunk order, requests per chunk,
salvaging a partial run, aggregation, the report's suite means with 95% half-widths and paired
differences, and the CLI's model-directory check."""

import json
import math
import statistics

import pytest

from sfi_vllm.tools import cli
from sfi_vllm.tools.engine_job import load_stream
from sfi_vllm.tools.quality import report
from sfi_vllm.tools.quality.runner import (aggregate, build_flow_requests, build_requests, check_model_dir, chunk_order,
                                     load_suite, per_request, prefix_cache_summary, rescore, resolve_dtype,
                                     save_suite)
from sfi_vllm.tools.request_flow import RequestFlow
from sfi_vllm.tools.quality.tasks import Sample

TASKS = ("passkey", "common_words")


def samples(n=3, contexts=(2048,)):
    out = []
    for c in contexts:
        for t in TASKS:
            for i in range(n):
                kind = "retrieval" if t == "passkey" else "aggregation"
                out.append(Sample(task=t, context_tokens=c, index=i, prompt=f"{t} {c} {i}", answers=(f"a{i}",),
                                  max_new_tokens=8, kind=kind))
    return out


@pytest.mark.parametrize("name", ["suite.jsonl", "suite.jsonl.xz"])
def test_suite_file_round_trip_and_filters(tmp_path, name):
    s = samples(3, (2048, 4096))
    save_suite(s, tmp_path / name)
    assert load_suite(tmp_path / name) == s
    got = load_suite(tmp_path / name, tasks={"passkey"}, contexts={4096}, n=2)
    assert [(x.task, x.context_tokens, x.index) for x in got] == [("passkey", 4096, 0), ("passkey", 4096, 1)]
    assert isinstance(got[0].answers, tuple)


def test_chunks_cover_every_task_and_put_dense_first():
    s = samples(3)
    order = chunk_order(s, TASKS, (2048,))
    assert [(s[i].index, s[i].task) for i in order[:2]] == [(0, "passkey"), (0, "common_words")]
    reqs, keys = build_requests(s, ["dense", "sfi", "streaming"], [0.1, 0.2], order, chunk_samples=2,
                                ablations=["sfi-nms"], ablation_samples=1)
    assert len(reqs) == len(keys)
    by_phase = {}
    for r, k in zip(reqs, keys):
        by_phase.setdefault(r["phase"], []).append(k)
    assert sorted(by_phase) == [0, 1, 2, 3, 4, 5]
    assert {k[1] for k in by_phase[0]} == {"dense"}
    assert {k[1] for k in by_phase[1]} == {"sfi", "streaming", "sfi-nms"}
    # every sample: 1 dense + 2 policies x 2 retentions (+ 2 ablation requests for index 0)
    for si, smp in enumerate(s):
        n = sum(1 for k in keys if k[0] == si)
        assert n == 5 + (2 if smp.index == 0 else 0)
    # a sample's requests all lie in one chunk (its dense phase and the next)
    for si in range(len(s)):
        phases = {r["phase"] for r, k in zip(reqs, keys) if k[0] == si}
        assert len(phases) == 2 and min(phases) % 2 == 0 and max(phases) == min(phases) + 1
    # no chunking: two phases
    reqs, _ = build_requests(s, ["dense", "sfi"], [0.1], order)
    assert {r["phase"] for r in reqs} == {0, 1}


def test_flow_requests_wait_for_their_samples_dense_request():
    s = samples(3)
    order = chunk_order(s, TASKS, (2048,))
    reqs, keys = build_flow_requests(s, ["dense", "sfi", "streaming"], [0.1, 0.2], order,
                                     ablations=["sfi-nms"], ablation_samples=1)
    assert len(reqs) == len(keys)
    roots = [i for i, r in enumerate(reqs) if "after" not in r]
    assert [keys[i][1] for i in roots] == ["dense"] * len(s)
    assert [keys[i][0] for i in roots] == order  # samples open in chunk order
    for i, (r, (si, pol, ret)) in enumerate(zip(reqs, keys)):
        if pol == "dense":
            assert r["sfi"] == {"policy": "dense"} and "phase" not in r and r["prompt"] == s[si].prompt
        else:
            assert keys[r["after"]] == (si, "dense", None) and r["after"] < i and "prompt" not in r
            assert r["sfi"]["policy"] == ("sfi" if pol.startswith("sfi") else pol)
    for si, smp in enumerate(s):
        assert sum(1 for k in keys if k[0] == si) == 5 + (2 if smp.index == 0 else 0)
    # the flow opens them in that order, a sample's followers once its dense request is done
    flow = RequestFlow([r.get("after") for r in reqs], max_open=2)
    first = flow.next_requests()
    assert [keys[i] for i in first] == [(order[0], "dense", None), (order[1], "dense", None)]
    flow.finished(first[0])
    assert {keys[i][0] for i in flow.next_requests()} == {order[0]}


def test_prefix_cache_summary():
    keys = [(0, "dense", None), (0, "sfi", 0.1), (0, "quest", 0.1), (1, "dense", None), (1, "sfi", 0.1)]
    outs = [dict(prompt_tokens=100, cached_tokens=0), dict(prompt_tokens=100, cached_tokens=96),
            dict(prompt_tokens=100, cached_tokens=0), dict(prompt_tokens=50, cached_tokens=0), None]
    assert prefix_cache_summary(keys, dict(outputs=outs)) == (
        "prefix cache: 2 non-dense requests, 48.0% of their prompt tokens cached (vLLM caches whole KV blocks "
        "only), 52.0 tokens each left to prefill on average")
    assert prefix_cache_summary(keys, dict(outputs=[dict(prompt_tokens=1)] * 5)) is None


def _fake_result(s, keys, run, answer_ok):
    outs, stats = [], {}
    for i, (si, pol, r) in enumerate(keys):
        if si not in run:
            outs.append(None)
            continue
        text = f"the answer is a{s[si].index}" if answer_ok(pol, si) else "no idea"
        outs.append(dict(request_id=str(i), prompt_tokens=10, text=text, token_ids=[1, 2, 3] if pol == "dense" else [1, 2, 4],
                         finish_reason="stop"))
        stats[str(i)] = dict(attended_fraction=0.2, fast_steps=2, slow_steps=1, decode_steps=3)
    return dict(outputs=outs, sfi_stats=stats, skipped=sum(o is None for o in outs))


def test_partial_runs_score_only_complete_samples():
    s = samples(3)
    order = chunk_order(s, TASKS, (2048,))
    reqs, keys = build_requests(s, ["dense", "sfi"], [0.1], order, chunk_samples=2)
    run = set(order[:4])  # two chunks finished
    res = _fake_result(s, keys, run, lambda pol, si: pol == "dense" or s[si].index == 0)
    per, dropped = per_request(s, keys, res)
    assert dropped == 2
    assert {p["index"] for p in per} == {0, 1}
    rows = aggregate(per)
    sfi_pk = next(r for r in rows if r["policy"] == "sfi" and r["task"] == "passkey")
    assert sfi_pk["n"] == 2 and sfi_pk["score"] == 50.0 and sfi_pk["retention"] == 0.1
    assert sfi_pk["ci95"] == round(1.96 * statistics.stdev([100, 0]) / math.sqrt(2), 2)
    assert sfi_pk["agree_tokens"] == 2 and sfi_pk["measured_retention"] == 0.2 and sfi_pk["slow_step_rate"] == round(1 / 3, 4)
    dense = next(r for r in rows if r["policy"] == "dense" and r["task"] == "passkey")
    assert dense["score"] == 100.0 and dense["retention"] == 1.0


def test_rescore_merges_runs_over_disjoint_samples(tmp_path):
    s = samples(4)
    order = chunk_order(s, TASKS, (2048,))
    _, keys = build_requests(s, ["dense", "sfi"], [0.1], order)
    res = _fake_result(s, keys, set(order), lambda pol, si: pol == "dense" or s[si].index % 2 == 0)
    per, _ = per_request(s, keys, res)
    paths = []
    for name, part in (("a", [p for p in per if p["index"] < 2]), ("b", [p for p in per if p["index"] >= 1])):
        paths.append(tmp_path / f"{name}.jsonl")  # index 1 is in both
        paths[-1].write_text("".join(json.dumps(p) + "\n" for p in part))
    rows = rescore([str(p) for p in paths], str(tmp_path / "rows.jsonl"), str(tmp_path / "merged.jsonl"))
    assert rows == aggregate(per)
    assert [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()] == rows
    assert len((tmp_path / "merged.jsonl").read_text().splitlines()) == len(per)


def test_load_stream_salvages_finished_lines(tmp_path):
    p = tmp_path / "stream.jsonl"
    p.write_text(json.dumps({"index": 1, "request_id": "7", "text": "x", "token_ids": [1], "sfi_stats": {"fast_steps": 1}})
                 + "\n" + '{"index": 2, "request_id"')  # a line cut off by a kill
    res = load_stream(p, 3)
    assert res["outputs"][0] is None and res["outputs"][2] is None
    assert res["outputs"][1]["text"] == "x" and res["sfi_stats"] == {"7": {"fast_steps": 1}}
    assert res["skipped"] == 2
    assert load_stream(tmp_path / "missing", 2)["skipped"] == 2


@pytest.mark.parametrize("engine_loaded", [False, True])
def test_eval_salvages_only_what_this_run_streamed(monkeypatch, tmp_path, engine_loaded):
    """An engine that fails before it has loaded leaves --stream untouched: an earlier run's lines
    there are not scored as this run's (and --out is left as it was). One that fails after it has
    loaded and finished a request has that request scored."""
    from sfi_vllm.tools import engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.quality.runner import run_eval

    stream, out = tmp_path / "stream.jsonl", tmp_path / "q.jsonl"
    record = {"index": 0, "request_id": "0", "prompt_tokens": 9, "cached_tokens": 0, "text": "no answer",
              "token_ids": [1, 2], "finish_reason": "length", "sfi_stats": {}}
    stream.write_text(json.dumps({**record, "text": "an earlier run"}) + "\n")
    out.write_text("an earlier run's rows\n")

    def engine(job, env=None, quiet=True, timeout=None):
        assert job.stream_out == str(stream)
        if engine_loaded:  # what the engine process does once loaded, then after a request
            open(job.stream_out, "w").close()
            with open(job.stream_out, "a") as f:
                f.write(json.dumps(record) + "\n")
        raise RuntimeError("the engine process died")

    monkeypatch.setattr(engine_job, "run_engine_job", engine)
    kw = dict(policies=("dense",), retentions=(0.1,), contexts=(512,), tasks=("passkey",), n=1, out=str(out),
              model=str(prepare_model(progress=False)), stream_out=str(stream), progress=False)
    if not engine_loaded:
        with pytest.raises(RuntimeError, match="failed before any sample was scored"):
            run_eval(**kw)
        assert out.read_text() == "an earlier run's rows\n"
        assert "an earlier run" in stream.read_text()
        return
    with pytest.raises(RuntimeError, match="holds the 1 rows of the samples it finished"):
        run_eval(**kw)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["policy"] == "dense" and row["n"] == 1 and row["score"] == 0.0


def test_stratified_suite_mean_and_half_width():
    rows = [dict(policy="sfi", task="a", kind="retrieval", context=2048, retention=0.1, score=40.0, n=100, ci95=9.8),
            dict(policy="sfi", task="b", kind="aggregation", context=2048, retention=0.1, score=20.0, n=100, ci95=7.84)]
    mean, ci = report.stratified_mean(rows)
    assert mean == 30.0
    assert ci == round(1.96 * math.sqrt(5.0 ** 2 + 4.0 ** 2) / 2, 2)
    (m,) = report.suite_means(rows)
    assert (m["score"], m["ci95"], m["retrieval"], m["retrieval_ci95"], m["aggregation"]) == (30.0, ci, 40.0, 9.8, 20.0)
    assert report.stratified_mean([dict(rows[0], ci95=None)]) == (40.0, None)


def test_paired_differences_against_sfi():
    raw = []
    for i, (sd, ss, sq) in enumerate([(1, 1, 0), (1, 0, 0), (0, 0, 1)]):
        raw += [dict(policy="dense", retention=None, task="t", context=2048, index=i, score=sd),
                dict(policy="sfi", retention=0.1, task="t", context=2048, index=i, score=ss),
                dict(policy="quest", retention=0.1, task="t", context=2048, index=i, score=sq)]
    diffs = {d["policy"]: d for d in report.paired_differences(raw)}
    assert diffs["dense"]["diff"] == round(100 * (0 - 1 + 0) / 3, 2)
    assert diffs["quest"]["diff"] == round(100 * (1 + 0 - 1) / 3, 2)
    assert diffs["quest"]["ci95"] == round(1.96 * statistics.stdev([100, 0, -100]) / math.sqrt(3), 2)
    assert diffs["dense"]["n_min"] == 3 and diffs["dense"]["retention"] == 0.1


def test_markdown_and_plot(tmp_path):
    rows = []
    for pol, ret in (("dense", 1.0), ("sfi", 0.1), ("sfi", 0.2), ("quest", 0.1)):
        for t, kind in (("passkey", "retrieval"), ("common_words", "aggregation")):
            for ctx in (2048, 4096):
                rows.append(dict(policy=pol, task=t, kind=kind, context=ctx, retention=ret, score=50.0, n=10, ci95=30.0,
                                 measured_retention=ret, slow_step_rate=0.1, agree_tokens=3.0))
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.write_report(str(path), str(tmp_path / "q"), "t", "cmd")
    md = (tmp_path / "q.md").read_text()
    assert "| 4096 | 0.10 | sfi | 50.0 ± 21.2 | 50.0 ± 30.0 | 50.0 ± 30.0 | 10 |" in md
    assert (tmp_path / "q.png").stat().st_size > 0


def test_model_dir_check(tmp_path, capsys):
    with pytest.raises(ValueError, match="no such directory"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert check_model_dir(tmp_path) == str(tmp_path.resolve())
    assert cli.main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli.main(["fidelity", "--model", str(tmp_path / "nope")]) == 2
    capsys.readouterr()
    # a bad engine setting is named first, whatever the model directory
    assert cli.main(["fidelity", "--model", str(tmp_path / "nope"), "--sfi", '{"recent_window": 0}']) == 2
    err = capsys.readouterr().err
    assert "recent_window" in err and "no such directory" not in err


def test_dtype_and_engine_options_parse():
    assert resolve_dtype("float16") == "float16"
    assert resolve_dtype("auto") in ("float32", "bfloat16")
    args = cli.build_parser().parse_args(["eval", "--dtype", "bfloat16", "--max-num-seqs", "256",
                                          "--gpu-memory-utilization", "0.8", "--chunk-samples", "70",
                                          "--time-limit", "300", "--ablations", "sfi-nms", "--ablation-samples", "5"])
    assert (args.dtype, args.max_num_seqs, args.gpu_memory_utilization, args.chunk_samples, args.time_limit) == \
        ("bfloat16", 256, 0.8, 70, 300.0)
    assert "bfloat16 on CUDA" in cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()


def test_engine_sfi_sizes_the_buffers_for_every_request(tmp_path, monkeypatch):
    """eval and fidelity size their engine's compact buffers for the largest request, or refuse,
    before anything runs (the engine's default K held 2052 tokens: retention 0.3 at 8K was
    refused request by request after the dense phase had run)."""
    from sfi_vllm.config import build_config
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.tools.quality.runner import engine_sfi

    assert engine_sfi(["dense", "sfi"], [0.1, 0.2], [2048], 2560) == {}  # the engine's defaults hold them
    assert engine_sfi(["sfi@0"], [0.1], [8192], 8192, {"selected_tokens": 512}) == {"selected_tokens": 512}
    policies = ["dense", "sfi", "quest", "streaming", "snapkv"]
    sfi = engine_sfi(policies, [0.3], [8192], 8192)
    need = max(build_config(policy_overrides(p, 0.3, 8192), use_env=False).compact_capacity(8192)
               for p in policies if p != "dense")
    assert build_config(sfi, use_env=False).compact_capacity(8192) == need > 2052
    # $SFI_CONFIG applies under the settings, as in the engine: its fraction holds 10% of 8K, and
    # a K given over it replaces it where it does not hold 30%
    monkeypatch.setenv("SFI_CONFIG", str(tmp_path / "sfi.yaml"))
    (tmp_path / "sfi.yaml").write_text("selected_fraction: 0.1\n")
    assert engine_sfi(["sfi"], [0.1], [8192], 8192) == {}
    raised = build_config(engine_sfi(["sfi"], [0.3], [8192], 8192))
    assert raised.selected_fraction is None and raised.compact_capacity(8192) == build_config(
        policy_overrides("sfi", 0.3, 8192), use_env=False).compact_capacity(8192)
    given = {"selected_tokens": 512, "reuse_budget": 30}
    assert engine_sfi(["sfi"], [0.05], [8192], 8192, given) == given  # a budget the caller set is kept
    with pytest.raises(ValueError, match=r"retention 0.3 and context 8192 needs sinks \+ K"):
        engine_sfi(["sfi"], [0.3], [8192], 8192, given)


def test_an_engine_failure_fails_the_eval_and_keeps_an_earlier_output(tmp_path, monkeypatch):
    """A failed engine once ended the eval with exit status 0 and an emptied --out."""
    import sfi_vllm.tools.engine_job as engine_job
    from sfi_vllm.tools.quality.runner import run_eval

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    suite = tmp_path / "suite.jsonl"
    save_suite(samples(), suite)
    out = tmp_path / "q.jsonl"
    out.write_text('{"earlier": 1}\n')

    def engine_dies(job, env=None, quiet=False):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(engine_job, "run_engine_job", engine_dies)
    with pytest.raises(RuntimeError, match="engine failed before any sample was scored"):
        run_eval(policies=["dense", "sfi"], contexts=[2048], tasks=TASKS, n=3, out=str(out), model=str(model),
                 suite=str(suite), dtype="float32", progress=False)
    assert out.read_text() == '{"earlier": 1}\n'
    # a context the model cannot hold is refused before the suite is read or an engine starts
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings"):
        run_eval(policies=["dense"], contexts=[16384], tasks=TASKS, out=str(out), model=str(model),
                 suite=str(suite), dtype="float32")


def test_requests_that_fell_back_to_dense_for_a_full_pool_are_not_scored(tmp_path, monkeypatch):
    """On the GPU a request that finds every compact set taken runs densely: scored, it would credit
    dense's answer to its policy. The eval leaves its sample out and fails the run, saying why."""
    import sfi_vllm.tools.engine_job as engine_job
    from sfi_vllm.tools.quality.runner import run_eval, without_pool_fallbacks

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    suite = tmp_path / "suite.jsonl"
    save_suite(samples(), suite)
    out, raw = tmp_path / "q.jsonl", tmp_path / "raw.jsonl"

    def engine_runs(job, env=None, quiet=False):
        outs, stats = [], {}
        for i, _ in enumerate(job.requests):
            outs.append(dict(request_id=str(i), prompt_tokens=10, text="no idea", token_ids=[1, 2], finish_reason="stop"))
            stats[str(i)] = dict(fallback="compact_pool_full") if i == len(job.requests) - 1 else {}
        return dict(outputs=outs, sfi_stats=stats, skipped=0, load_s=0.0, generate_s=0.0)

    monkeypatch.setattr(engine_job, "run_engine_job", engine_runs)
    with pytest.raises(RuntimeError, match="1 of 18 requests ran with dense attention because every compact set "
                                           "was taken"):
        run_eval(policies=["dense", "sfi"], contexts=[2048], tasks=TASKS, n=3, out=str(out), raw_out=str(raw),
                 model=str(model), suite=str(suite), dtype="float32", progress=False, retentions=(0.1, 0.2))
    per = [json.loads(line) for line in raw.read_text().splitlines()]
    assert len(per) == 15 and all(p["fallback"] is None for p in per)  # the sample's three requests left out
    assert out.read_text()  # the other samples' rows
    kept, fell = without_pool_fallbacks([dict(task="t", context=1, index=0, fallback="compact_pool_full"),
                                         dict(task="t", context=1, index=0, fallback=None),
                                         dict(task="t", context=1, index=1, fallback=None)])
    assert fell == 1 and [p["index"] for p in kept] == [1]


def test_quality_engines_refuse_a_pool_smaller_than_their_batch():
    """A quality run's engine job stops before generating when the compact-set pool holds fewer
    sets than max_num_seqs (requests beyond it would run densely); the CPU's pool holds every
    sequence, and workers in other processes are checked when the run is scored."""
    from types import SimpleNamespace

    from sfi_vllm.tools.engine_job import EngineJob, check_compact_sets

    assert EngineJob(model="m").require_compact_sets is False
    check_compact_sets(None)
    check_compact_sets(SimpleNamespace(compact_slots=8, num_slots=8))
    with pytest.raises(RuntimeError, match="the compact-set pool holds 89 sets for max_num_seqs 512"):
        check_compact_sets(SimpleNamespace(compact_slots=89, num_slots=512))
