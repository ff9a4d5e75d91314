"""`sfi-vllm eval` end to end through a real vLLM engine (CPU here, the embedded SmolLM2): the
command a user runs, on the smallest suite it accepts, with its rows, raw records, table and plot."""

import json

import pytest

from sfi_vllm.tools import cli


@pytest.mark.engine
def test_eval_command_runs_the_suite_through_vllm(tmp_path):
    out, raw, rep = tmp_path / "q.jsonl", tmp_path / "q-raw.jsonl", tmp_path / "q"
    stream = tmp_path / "stream.jsonl"
    stream.write_text('{"index": 99, "request_id": "an earlier run"}\n')
    rc = cli.main(["eval", "--contexts", "512", "--tasks", "passkey,niah_single", "--samples", "1",
                   "--policies", "dense,sfi,sfi-selected-bridge,streaming", "--retentions", "0.2", "--out", str(out),
                   "--raw", str(raw), "--report", str(rep), "--no-progress", "--kv-cache-gib", "2",
                   "--stream", str(stream)])
    assert rc == 0
    # the stream holds this run's requests only: the earlier run's line is gone
    assert sorted(json.loads(line)["index"] for line in stream.read_text().splitlines()) == list(range(8))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # one row per policy x task x context x budget (dense at retention 1), with the fields
    assert {(r["policy"], r["task"], r["context"], r["retention"]) for r in rows} == {
        (p, t, 512, ret) for p, ret in (("dense", 1.0), ("sfi", 0.2), ("sfi-selected-bridge", 0.2),
                                        ("streaming", 0.2))
        for t in ("passkey", "niah_single")}
    for r in rows:
        assert r["n"] == 1 and 0.0 <= r["score"] <= 100.0 and r["kind"] == "retrieval"
    recs = [json.loads(line) for line in raw.read_text().splitlines()]
    assert len(recs) == 8 and all(r["config_error"] is None for r in recs)
    by = {(r["policy"], r["task"]): r for r in recs}
    for t in ("passkey", "niah_single"):
        assert by[("dense", t)]["fast_steps"] == 0
        sfi = by[("sfi", t)]
        # the first bridge_steps decode steps are dense, the next one slow; later ones may be fast
        assert sfi["dense_steps"] + sfi["fast_steps"] + sfi["slow_steps"] == sfi["decode_steps"]
        assert sfi["dense_steps"] == min(sfi["decode_steps"], 16)
        if sfi["decode_steps"] > 16:
            assert sfi["slow_steps"] >= 1
        # each row's score is the mean of its raw records' (0/1 per expected string, in percent)
        row = next(r for r in rows if r["policy"] == "sfi" and r["task"] == t)
        assert row["score"] == pytest.approx(100 * sfi["score"], abs=0.01)
        # bridge_attention selected: no dense step; a provisional selection at the first decode
        # step, the first selection proper at the 17th
        sel = by[("sfi-selected-bridge", t)]
        assert sel["dense_steps"] == 0 and sel["slow_reasons"].get("first_decode") == 1
        assert sel["slow_reasons"].get("bridge_end", 0) == (1 if sel["decode_steps"] > 16 else 0)
    table = (tmp_path / "q.md").read_text()
    assert "| 0.20 | sfi |" in table and "| 1.00 | dense |" in table
    assert (tmp_path / "q.png").stat().st_size > 1000


@pytest.mark.engine
def test_eval_refusals_before_scoring_are_one_line(tmp_path, capfd):
    """Engine options vLLM refuses (in the engine's own process) and a --suite file that is not a
    suite end the command with one line and status 2, not tracebacks."""
    from sfi_vllm.tools.model_prep import prepare_model

    model = str(prepare_model(progress=False))
    base = ["eval", "--model", model, "--contexts", "512", "--tasks", "niah_single", "--samples", "1",
            "--policies", "sfi", "--retentions", "0.1", "--out", str(tmp_path / "q.jsonl"), "--no-progress"]
    earlier_stream = tmp_path / "stream.jsonl"  # an earlier run's finished requests
    earlier_stream.write_text('{"index": 0, "request_id": "0"}\n')
    assert cli.main(base + ["--dtype", "foo", "--stream", str(earlier_stream)]) == 2
    err = capfd.readouterr().err  # this process's and the engine process's
    assert "sfi-vllm eval: vLLM refused the engine's options (ModelConfig): dtype:" in err
    assert "Traceback" not in err
    assert earlier_stream.read_text() == '{"index": 0, "request_id": "0"}\n'  # no engine ran: left as it was
    not_a_suite = tmp_path / "rows.jsonl"
    not_a_suite.write_text('{"policy": "sfi"}\n')
    assert cli.main(base + ["--suite", str(not_a_suite)]) == 2
    assert f"--suite {not_a_suite}: not a file of `sfi-vllm suite`" in capfd.readouterr().err
    assert not (tmp_path / "q.jsonl").exists()
