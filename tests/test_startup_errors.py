"""sfi-vllm's start-up errors reach the user as their message, one line per bad field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import BaseModel, model_validator

from sfi_vllm.config import SFIConfigError, build_config
from sfi_vllm.startup_errors import startup_message


class _LikeVllmConfig(BaseModel):
    """Stands in for vLLM's VllmConfig: a pydantic model whose validation raises our error."""

    sfi: dict

    @model_validator(mode="after")
    def _check(self):
        build_config(self.sfi, use_env=False)
        return self


def test_message_is_found_inside_pydantics_wrapper():
    with pytest.raises(Exception) as e:
        _LikeVllmConfig(sfi={"recent_window": 0, "sinks": -1})
    assert type(e.value).__name__ == "ValidationError"  # what vLLM's start-up raises
    msg = startup_message(e.value)
    assert msg is not None and msg.splitlines() == [
        "invalid SFI configuration:",
        "  sfi.sinks: Input should be greater than or equal to 0 (allowed: 0 <= value <= 4096); got -1",
        "  sfi.recent_window: Input should be greater than or equal to 1 (allowed: 1 <= value <= 1048576); got 0",
    ]


def test_other_errors_are_not_ours():
    assert startup_message(ValueError("x")) is None
    try:
        try:
            raise SFIConfigError("inner")
        except SFIConfigError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as e:
        assert startup_message(e) == "inner"


@pytest.mark.parametrize("debug", [False, True])
def test_cli_prints_one_line_per_field_without_traceback(debug):
    cmd = [sys.executable, "-m", "sfi_vllm.tools.cli", "config", "--sfi", '{"recent_window": 0}']
    proc = subprocess.run(cmd + (["--debug"] if debug else []), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "sfi.recent_window: Input should be greater than or equal to 1" in proc.stderr
    assert ("Traceback" in proc.stderr) == debug
    if not debug:  # the command's own flag, not only the environment variable
        assert "(traceback: --debug)" in proc.stderr


def test_cli_output_to_a_reader_that_left_ends_without_a_traceback():
    """``sfi-vllm config --markdown | head -1``: the reader closes the pipe before the command's
    output is written (here a reader that reads nothing)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as in a shell
    for extra in ([], ["--markdown"]):  # output that fits the buffer, and output that does not
        cmd = [sys.executable, "-m", "sfi_vllm.tools.cli", "config", *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 1, err[-2000:]
        assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
        assert "a pipe was closed before the output was written" in err


def test_uncaught_error_prints_without_traceback_once_the_plugin_is_loaded():
    code = ("import sfi_vllm.plugin as p; p.register(); from sfi_vllm.config import build_config; "
            "build_config({'recent_window': 0}, use_env=False)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "sfi.recent_window" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_compact_budget_that_holds_no_set_is_refused_before_the_engine_starts():
    """sfi.compact_memory_gib too small for one sequence's compact set: vLLM's config step (in the
    front end, before any engine process) raises the field's one-line message, which is also what
    the start-up handler prints."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from sfi_vllm.tools.model_prep import prepare_model

    load_general_plugins()
    model = str(prepare_model(progress=False))
    args = dict(model=model, attention_backend="sfi", dtype="float32", max_model_len=1024)
    with pytest.raises(Exception) as e:
        EngineArgs(**args, additional_config={"sfi": {"compact_memory_gib": 0.0001}}).create_engine_config()
    msg = startup_message(e.value)
    assert msg is not None and msg.startswith("sfi.compact_memory_gib: a budget of 0.000 GiB"), msg
    assert "holds no sequence's compact set" in msg and "\n" not in msg
    # a budget that holds one set passes the check (SmolLM2 at 1024 tokens: well under 0.1 GiB per set)
    EngineArgs(**args, additional_config={"sfi": {"compact_memory_gib": 0.1}}).create_engine_config()


@pytest.mark.parametrize("attention_backend, extra, needle", [
    # SFI settings on an engine without the SFI backend would be ignored
    (None, dict(additional_config={"sfi": {"selected_tokens": 64}}), "add --attention-backend sfi (offline"),
    # SFI's key written otherwise would be ignored, with the SFI backend or without it
    ("sfi", dict(additional_config={"SFI": {"policy": "dense"}}), "'SFI' is not SFI's key"),
    (None, dict(additional_config={"sfi-vllm": {"policy": "dense"}}), "'sfi-vllm' is not SFI's key"),
    # what the SFI backends cannot read
    ("sfi", dict(kv_cache_dtype="fp8"), "model's dtype; got --kv-cache-dtype fp8: drop --kv-cache-dtype"),
    ("sfi", dict(kv_cache_dtype="bfloat16"), "got --kv-cache-dtype bfloat16"),  # on the CPU: auto only
    ("sfi", dict(additional_config={"sfi": {"boundary_token_ids": [13, 99999999]}}),
     "sfi.boundary_token_ids: [99999999] are not token ids of this model"),
    # found in the front end, not only in the engine's process (where it comes inside worker tracebacks)
    ("sfi", dict(additional_config={"sfi": {"stats_file": "/nonexistent-dir/stats.jsonl"}}),
     "sfi.stats_file: cannot append to '/nonexistent-dir/stats.jsonl'"),
    # quest with a fraction: pages larger than any K the fraction gives within max_model_len (1024)
    ("sfi", dict(additional_config={"sfi": {"policy": "quest", "selected_fraction": 0.001, "quest_page": 128}}),
     "sfi.quest_page (128) must be <= 64, the largest K that selected_fraction 0.001 gives within max_model_len 1024"),
    # a directory is writable but cannot be appended to
    ("sfi", dict(additional_config={"sfi": {"stats_file": "/tmp"}}), "sfi.stats_file: cannot append to '/tmp'"),
])
def test_start_up_refusals_in_the_front_end(attention_backend, extra, needle):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from sfi_vllm.tools.model_prep import prepare_model

    load_general_plugins()
    args = dict(model=str(prepare_model(progress=False)), dtype="float32", max_model_len=1024, **extra)
    if attention_backend:
        args["attention_backend"] = attention_backend
    with pytest.raises(Exception) as e:
        EngineArgs(**args).create_engine_config()
    msg = startup_message(e.value)
    assert msg is not None and needle in msg, msg


def test_the_printed_message_names_sfi_vllm_once(capsys):
    from sfi_vllm.patches.config_check import SFIStartupError
    from sfi_vllm.startup_errors import report

    assert report(SFIStartupError("sfi-vllm cannot serve this configuration: x"), prog="sfi-vllm batch")
    assert report(SFIConfigError("sfi.sinks: bad"), prog="sfi-vllm batch")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "sfi-vllm cannot serve this configuration: x" and err[2] == "sfi-vllm batch: sfi.sinks: bad"


def test_the_kv_cache_must_be_in_the_models_dtype():
    import torch

    from sfi_vllm.patches.config_check import kv_cache_in_model_dtype

    assert kv_cache_in_model_dtype("auto", torch.float32, cuda=False)
    assert kv_cache_in_model_dtype("bfloat16", torch.bfloat16, cuda=True)
    assert not kv_cache_in_model_dtype("bfloat16", torch.float16, cuda=True)
    assert not kv_cache_in_model_dtype("bfloat16", torch.bfloat16, cuda=False)  # the CPU backend: auto only
    assert not kv_cache_in_model_dtype("fp8_e4m3", torch.bfloat16, cuda=True)


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--prompts", "0"], "--prompts: must be at least 1, got 0"),
    (["batch", "in.jsonl", "out.jsonl", "--max-open", "-1"], "--max-open: must be at least 1, got -1"),
    (["eval", "--samples", "two"], "--samples: not an integer: 'two'"),
    (["eval", "--time-limit", "0"], "--time-limit: must be a positive number"),
    (["eval", "--first-sample", "-3"], "--first-sample: must be 0 or more"),
    # lists: each entry is checked before anything loads (these failed after the suite was built)
    (["eval", "--retentions", "0.1,"], "--retentions: a comma-separated list of retentions without empty"),
    (["eval", "--retentions", "nan"], "a retention is a fraction of the context in [0, 1]"),
    (["fidelity", "--retentions", "-0.1"], "a retention is a fraction of the context in [0, 1]"),
    (["eval", "--policies", "sfi,bogus"], "unknown policy 'bogus'"),
    (["eval", "--policies", "sfi@0.1/2"], "got 2"),
    (["eval", "--tasks", "passkey,nope"], "unknown task 'nope'"),
    (["suite", "--out", "s.jsonl", "--contexts", "2048,0"], "--contexts: a suite's context holds at least 512"),
    (["eval", "--contexts", "100"], "--contexts: a suite's context holds at least 512 tokens, got 100"),
])
def test_cli_refuses_counts_that_leave_nothing_to_run(argv, needle, capsys):
    """A count of 0 or below once made `demo` and `batch` wait for ever after the engine loaded
    (nothing was ever handed to it); argparse now refuses it before anything loads."""
    from sfi_vllm.tools.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_run_requests_refuses_a_max_open_below_one():
    from sfi_vllm.tools.batch import run_requests

    with pytest.raises(ValueError, match="max_open must be at least 1"):
        run_requests(object(), iter([]), lambda rec: None, max_open=0)


def test_cli_lists_parse_to_values():
    from sfi_vllm.tools.cli import build_parser

    args = build_parser().parse_args(["eval", "--policies", "dense,sfi@0/0.2", "--retentions", "0.1, 0.2",
                                      "--contexts", "2048,4096", "--tasks", "passkey"])
    assert (args.policies, args.retentions, args.contexts, args.tasks) == (
        ["dense", "sfi@0/0.2"], [0.1, 0.2], [2048, 4096], ["passkey"])
    assert build_parser().parse_args(["eval"]).retentions == [0.1, 0.2]  # the defaults parse too


def test_demo_sfi_replace_needs_sfi():
    from sfi_vllm.tools import cli

    with pytest.raises(cli.UsageError, match="--sfi-replace: give the whole SFI config in --sfi"):
        cli._cmd_demo(cli.build_parser().parse_args(["demo", "--sfi-replace"]))


def test_demo_runs_the_lossless_mode_through_its_flag():
    from sfi_vllm.tools import cli

    with pytest.raises(cli.UsageError, match="the demo runs the lossless mode with --lossless"):
        cli._cmd_demo(cli.build_parser().parse_args(["demo", "--sfi", '{"mode": "lossless"}']))


def test_cli_user_errors_are_one_line_with_exit_status_2(tmp_path, capsys):
    """A file that is missing or not what the command reads, bad engine keyword arguments and
    conflicting flags: one line naming the problem, no traceback (``--debug`` shows it)."""
    from sfi_vllm.tools import cli

    missing = str(tmp_path / "none.jsonl")
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"task": "passkey", "context": 1024, "index": 0, "prompt": "x"}\n')
    cases = [
        (["report", missing, str(tmp_path / "rep")], f"sfi-vllm report: {missing}: No such file or directory"),
        (["report", str(suite), str(tmp_path / "rep")], "not the rows of sfi-vllm eval (--out): "
                                                        "a record has no 'policy' field"),
        (["rescore", str(suite), "--out", str(tmp_path / "r.jsonl")], "a record has no 'policy' field"),
        (["fidelity", "--from-raw", missing, "--out", str(tmp_path / "f.jsonl")], "No such file or directory"),
        (["fidelity", "--from-raw", str(suite), "--out", str(tmp_path / "f.jsonl")],
         "not the --raw records of sfi-vllm fidelity: a record has no 'kind' field"),
        (["config", "--markdown", "--sfi", '{"preset": "paper"}'], "--markdown prints the table"),
        (["batch", str(suite), str(tmp_path / "o.jsonl"), "--engine-kwargs", '{"max_model_length": 512}'],
         "'max_model_length' is not a keyword argument of vllm.LLM; did you mean 'max_model_len'?"),
    ]
    for argv, needle in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    with pytest.raises(FileNotFoundError):
        cli.main(cases[0][0] + ["--debug"])


def test_batch_says_an_empty_input_holds_no_requests(tmp_path, capsys):
    from sfi_vllm.tools import cli

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["batch", str(empty), str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "none")]) == 0
    assert f"{empty} holds no requests" in capsys.readouterr().err


def test_fidelity_warns_when_its_tokens_are_bridge_steps_alone(monkeypatch, capsys):
    from sfi_vllm.tools import cli
    from sfi_vllm.tools.quality import fidelity

    def stop(**kw):
        raise cli.UsageError("stopped before the engine")

    monkeypatch.setattr(fidelity, "run_fidelity", stop)
    assert cli.main(["fidelity", "--tokens", "16", "--out", "f.jsonl"]) == 2
    assert "--tokens 16: the first 16 decode steps after a prompt attend densely" in capsys.readouterr().err
    assert cli.main(["fidelity", "--tokens", "17", "--out", "f.jsonl"]) == 2
    assert "attend densely" not in capsys.readouterr().err


def test_vllms_refusal_of_engine_options_is_one_line_naming_the_field():
    import pydantic
    from vllm.config import CompilationConfig

    from sfi_vllm.tools.cli import _user_error_line

    with pytest.raises(pydantic.ValidationError) as info:
        CompilationConfig(bogus=1)
    line = _user_error_line(info.value)
    assert line.startswith("vLLM refused the engine's options (CompilationConfig): bogus: "), line

    class NotVllms(pydantic.BaseModel):
        x: int

    with pytest.raises(pydantic.ValidationError) as info:
        NotVllms(x="y")
    assert _user_error_line(info.value) is None  # another model's error keeps its traceback
    assert _user_error_line(FileNotFoundError(2, "No such file or directory", "/x")) == "/x: No such file or directory"
    assert _user_error_line(KeyError("policy")) is None


def test_report_checks_its_files_before_computing(tmp_path, capsys):
    from sfi_vllm.tools import cli

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"policy": "dense", "retention": 0.1, "context": 1024, "task": "passkey", "score": 1.0, "n": 1}\n')
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"policy": "dense", "retention": 0.1, "context": 1024, "task": "passkey", "score": 1.0}\n')
    assert cli.main(["report", str(rows), str(tmp_path / "rep"), "--raw", str(raw)]) == 2
    assert "not the records of sfi-vllm eval --raw: a record has no 'index' field" in capsys.readouterr().err
    # the per-request records where the rows belong (they have no sample count)
    raw.write_text('{"policy": "dense", "retention": 0.1, "context": 1024, "task": "passkey", "index": 0, '
                   '"score": 1.0}\n')
    assert cli.main(["report", str(raw), str(tmp_path / "rep")]) == 2
    assert "not the rows of sfi-vllm eval (--out): a record has no 'n' field" in capsys.readouterr().err


def test_reference_path_options_are_refused_with_the_gpu_kernels(monkeypatch):
    """experimental.candidate_pages and prompt_window exist on the torch reference path only: on a
    CUDA platform with the kernels, start-up names each (with sfi.kernels torch they pass)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from sfi_vllm.patches.config_check import SFIStartupError, check_sfi_engine

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *a: True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")

    def engine(**sfi):
        return SimpleNamespace(additional_config={"sfi": sfi}, model_config=None, speculative_config=None,
                               cache_config=SimpleNamespace(cache_dtype="auto"))

    with pytest.raises(SFIStartupError) as e:
        check_sfi_engine(engine(experimental={"prompt_window": 32, "candidate_pages": 2}))
    assert "sfi.experimental.prompt_window runs on the torch reference path only" in str(e.value)
    assert "sfi.experimental.candidate_pages runs on the torch reference path only" in str(e.value)
    try:
        check_sfi_engine(engine(kernels="torch", experimental={"prompt_window": 32, "candidate_pages": 2}))
    except SFIStartupError as err:
        assert "reference path" not in str(err)


def test_triton_kernels_are_refused_without_a_gpu(monkeypatch):
    """sfi.kernels triton asks for the GPU kernels: on a platform without CUDA start-up says so
    instead of serving on the torch reference path (auto and torch pass)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from sfi_vllm.patches.config_check import SFIStartupError, check_sfi_engine

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *a: False)

    def engine(**sfi):
        return SimpleNamespace(additional_config={"sfi": sfi}, model_config=None, speculative_config=None,
                               cache_config=SimpleNamespace(cache_dtype="auto"))

    with pytest.raises(SFIStartupError, match="sfi.kernels triton needs a CUDA GPU"):
        check_sfi_engine(engine(kernels="triton"))
    for kernels in ("auto", "torch"):
        check_sfi_engine(engine(kernels=kernels))


def test_outputs_are_checked_before_a_command_runs(tmp_path):
    """A long eval run, or an engine's load, does not end on an output that cannot be written:
    main makes the folders of the command's output files, tries each file for appending (leaving
    an existing file as it was and creating none), and refuses a folder, a folder that cannot be
    made, and two outputs that are one file, each as a usage error before anything runs."""
    from sfi_vllm.tools.cli import UsageError, build_parser, check_outputs

    def check(*argv, names=None):
        check_outputs(build_parser().parse_args(list(argv)), names)

    check("eval", "--out", str(tmp_path / "a" / "rows.jsonl"), "--raw", str(tmp_path / "b" / "c" / "raw.jsonl"))
    assert (tmp_path / "a").is_dir() and (tmp_path / "b" / "c").is_dir()
    assert list((tmp_path / "a").iterdir()) == []  # tried, not left behind
    check("report", "rows.jsonl", str(tmp_path / "d" / "table"))
    assert (tmp_path / "d").is_dir()
    kept = tmp_path / "kept.jsonl"
    kept.write_text("earlier results\n")
    check("batch", "in.jsonl", str(kept), names=("output",))  # as batch does once it has requests to run
    assert kept.read_text() == "earlier results\n"
    (tmp_path / "file").write_text("")
    refused = [
        (("suite", "--out", str(tmp_path / "file" / "x" / "s.jsonl")), "--out: cannot make the folder .* is a file"),
        (("batch", "in.jsonl", str(tmp_path / "file" / "o.jsonl")), "OUT.jsonl: cannot make the folder .* is a file"),
        (("batch", "in.jsonl", str(tmp_path)), "OUT.jsonl: .* is a folder; give a file"),
        (("demo", "--json", str(tmp_path)), "--json: .* is a folder"),
        (("eval", "--out", str(tmp_path / "q.jsonl"), "--raw", str(tmp_path / "q.jsonl")),
         "--raw: the same file as --out"),
        (("eval", "--out", str(tmp_path / "q.md"), "--report", str(tmp_path / "q")), "--report: the same file as --out"),
        (("fidelity", "--out", str(tmp_path / "f.jsonl"), "--report", str(tmp_path / "f.jsonl")),
         "--report: the same file as --out"),
    ]
    for argv, needle in refused:
        with pytest.raises(UsageError, match=needle):
            check(*argv, names=("output",) if argv[0] == "batch" else None)
    assert not (tmp_path / "q.jsonl").exists() and not (tmp_path / "f.jsonl").exists()
    # what is not a regular file is the command's: /dev/null twice, a link to nowhere (kept a link)
    check("eval", "--out", "/dev/null", "--raw", "/dev/null")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "nowhere" / "x.jsonl")
    check("eval", "--out", str(tmp_path / "link.jsonl"))
    assert (tmp_path / "link.jsonl").is_symlink() and not (tmp_path / "nowhere").exists()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UsageError, match="--out: .* is a loop of symbolic links"):
        check("eval", "--out", str(tmp_path / "loop"))
    with pytest.raises(UsageError, match="cannot make the folder .* a loop of links"):
        check("eval", "--out", str(tmp_path / "loop" / "q.jsonl"))
    # fidelity --from-raw writes no --raw; batch tries its output only when it has requests to run
    check("fidelity", "--from-raw", "r.jsonl", "--raw", str(tmp_path / "file" / "x.jsonl"),
          "--out", str(tmp_path / "f.jsonl"))
    check("batch", "in.jsonl", str(tmp_path / "file" / "o.jsonl"))


def test_an_output_is_not_an_input_nor_another_output_under_another_name(tmp_path):
    """An output that is one of the command's input files, by any name (a symbolic or a hard
    link), is refused before anything runs; so are two outputs that are one file by two names."""
    from sfi_vllm.tools.cli import UsageError, build_parser, check_outputs

    def check(*argv, names=None):
        check_outputs(build_parser().parse_args(list(argv)), names)

    suite, rows, raw = tmp_path / "suite.jsonl", tmp_path / "rows.jsonl", tmp_path / "raw.jsonl"
    for f in (suite, rows, raw):
        f.write_text("{}\n")
    os.link(rows, tmp_path / "rows-hard.jsonl")
    (tmp_path / "suite-link.jsonl").symlink_to(suite)
    refused = [
        (("eval", "--suite", f"{tmp_path / 'other.jsonl'},{suite}", "--stream", str(tmp_path / "suite-link.jsonl")),
         "--stream: the same file as the input --suite"),
        (("eval", "--out", str(rows), "--raw", str(tmp_path / "rows-hard.jsonl")), "--raw: the same file as --out"),
        (("rescore", f"{raw},{rows}", "--out", str(tmp_path / "rows-hard.jsonl")), "--out: the same file as the input RAW"),
        (("report", str(rows), str(tmp_path / "rows"), "--raw", str(tmp_path / "rows.md")), None),
        (("fidelity", "--from-raw", str(raw), "--out", str(raw)), "--out: the same file as the input --from-raw"),
    ]
    for argv, needle in refused:
        if needle is None:  # an input that is not there is the command's to report
            check(*argv)
            continue
        with pytest.raises(UsageError, match=needle):
            check(*argv)
    for f in (suite, rows, raw):
        assert f.read_text() == "{}\n"
    (tmp_path / "rows.md").write_text("a table\n")
    with pytest.raises(UsageError, match="PREFIX: the same file as the input --raw"):
        check("report", str(rows), str(tmp_path / "rows"), "--raw", str(tmp_path / "rows.md"))


def test_batch_refuses_its_input_as_its_output_by_any_name(tmp_path, capsys):
    from sfi_vllm.tools import cli

    data = tmp_path / "in.jsonl"
    data.write_text('{"custom_id": "a", "prompt": "hi"}\n')
    (tmp_path / "out.jsonl").symlink_to(data)
    os.link(data, tmp_path / "hard.jsonl")
    for out in ("out.jsonl", "hard.jsonl"):
        assert cli.main(["batch", str(data), str(tmp_path / out)]) == 2
        assert "the output is the input file" in capsys.readouterr().err
    assert data.read_text() == '{"custom_id": "a", "prompt": "hi"}\n'


def test_an_engine_jobs_refusal_is_read_from_its_result_file(tmp_path, monkeypatch):
    """eval's and fidelity's engines run in a process of their own; one whose options vLLM or
    sfi-vllm refused writes the one-line refusal in place of its result, which the command raises
    as EngineOptionsRefused whatever the process's exit status (a crash while tearing down a
    half-built engine included); any other failure keeps its log."""
    import json
    import subprocess

    from sfi_vllm.startup_errors import EngineOptionsRefused
    from sfi_vllm.tools import engine_job

    def fake_run(written, status):
        def run(cmd, **kw):
            if written is not None:
                from pathlib import Path

                Path(cmd[-1]).write_text(json.dumps(written))
            return subprocess.CompletedProcess(cmd, status)
        return run

    job = engine_job.EngineJob(model="/m", requests=[])
    for status in (engine_job._REFUSED, -11):
        monkeypatch.setattr(subprocess, "run", fake_run({"refused": "vLLM refused the engine's options"}, status))
        with pytest.raises(EngineOptionsRefused, match="^vLLM refused the engine's options$"):
            engine_job.run_engine_job(job)
    for written in (None, {"outputs": []}):
        monkeypatch.setattr(subprocess, "run", fake_run(written, engine_job._REFUSED))
        with pytest.raises(RuntimeError, match="engine job failed"):
            engine_job.run_engine_job(job)


def test_batch_model_is_a_prepared_directory_or_a_hub_name(tmp_path):
    from sfi_vllm.tools.cli import UsageError, _model_dir

    assert _model_dir("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"  # vLLM's to fetch
    for path in (str(tmp_path / "none"), "./none", "~/none-such-model"):
        with pytest.raises(UsageError, match="no such directory"):
            _model_dir(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        _model_dir(str(tmp_path / "empty"))


def test_a_missing_optional_package_names_its_extra(tmp_path, monkeypatch, capsys):
    """A command that needs a package of an extra says which extra to install, in one line; one
    that draws a plot at its end checks for matplotlib before it runs."""
    import sys

    from sfi_vllm.tools import cli
    from sfi_vllm.tools.model_prep import _check_deps

    line = cli._user_error_line(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert "pip install 'sfi-vllm[cpu]' (CPU) or 'sfi-vllm[gpu]' (CUDA)" in line
    assert cli._user_error_line(ModuleNotFoundError("x", name="vllm.some_module")) is None  # vLLM is there
    assert cli._user_error_line(ModuleNotFoundError("x", name="left_pad")) is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    assert cli.main(["report", str(rows), str(tmp_path / "table")]) == 2
    assert "needs the Python package matplotlib, which is not installed: pip install 'sfi-vllm[quality]'" \
        in capsys.readouterr().err
    assert cli.main(["eval", "--report", str(tmp_path / "q"), "--model", str(tmp_path / "no-model"),
                     "--out", str(tmp_path / "q.jsonl")]) == 2
    assert "sfi-vllm[quality]" in capsys.readouterr().err  # before the model is even looked at
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(RuntimeError, match=r"missing Python package\(s\) torch\. torch comes with vLLM"):
        _check_deps()


def test_version(capsys):
    from sfi_vllm import __version__
    from sfi_vllm.tools import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sfi-vllm {__version__}"


@pytest.mark.parametrize("text, needle", [
    ("[" * 5000, "--sfi: not valid JSON (maximum recursion depth"),  # nesting past the parser's depth
    ('{"sinks": ' + "1" * 5000 + "}", "--sfi: not valid JSON (Exceeds the limit"),  # an integer past Python's
    ('{"sinks": 1, "sinks": 2}', "--sfi: the key 'sinks' is given twice"),
])
def test_cli_json_that_the_parser_refuses_is_a_usage_error(text, needle, capsys):
    from sfi_vllm.tools.cli import main

    assert main(["config", "--sfi", text]) == 2
    assert needle in capsys.readouterr().err


def test_an_sfi_config_file_the_yaml_parser_refuses_names_the_file(tmp_path, monkeypatch):
    from sfi_vllm.config import build_config

    for name, text in (("deep.yaml", "a: " + "[" * 5000), ("big.yaml", "sinks: " + "1" * 5000)):
        (tmp_path / name).write_text(text)
        monkeypatch.setenv("SFI_CONFIG", str(tmp_path / name))
        with pytest.raises(SFIConfigError, match=f"SFI_CONFIG: .*{name} is not valid YAML"):
            build_config({})


def test_fidelity_refuses_a_context_too_short_for_its_documents(tmp_path, capsys):
    from sfi_vllm.tools import cli

    assert cli.main(["fidelity", "--contexts", "2048,100", "--tokens", "16", "--docs", "1",
                     "--out", str(tmp_path / "f.jsonl")]) == 2
    assert "--contexts 100: context 100 leaves no room for a document with 16 generated tokens" \
        in capsys.readouterr().err


def test_debug_flag_reaches_engine_processes_and_is_undone(monkeypatch):
    """--debug sets SFI_VLLM_DEBUG for the command's engine processes, and only for the command."""
    import os

    from sfi_vllm.startup_errors import DEBUG_ENV
    from sfi_vllm.tools import cli

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seen = []
    monkeypatch.setattr(cli, "_cmd_config", lambda args: seen.append(os.environ.get(DEBUG_ENV)) or 0)
    assert cli.main(["config", "--debug"]) == 0
    assert seen == ["1"] and DEBUG_ENV not in os.environ
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert cli.main(["config", "--debug"]) == 0
    assert seen == ["1", "1"] and os.environ[DEBUG_ENV] == "0"


def test_an_error_line_keeps_the_command_name_whatever_the_file_is_called(tmp_path, capsys, monkeypatch):
    from sfi_vllm.tools import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["rescore", "sfi-vllm-raw.jsonl", "--out", "rows.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("sfi-vllm rescore: sfi-vllm-raw.jsonl: No such file")


def test_a_finished_batch_tries_no_output(tmp_path, capsys, monkeypatch):
    """With every id already in the output there is nothing to write: the output is not tried
    (it may be read-only); with --retry-errors it is, before its error lines are taken out."""
    from sfi_vllm.tools import cli

    def refuse(args, names=None):
        if names == ("output",):  # batch's own output (main's general check finds none for batch)
            raise cli.UsageError("OUT.jsonl: cannot write")

    monkeypatch.setattr(cli, "check_outputs", refuse)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    out.write_text('{"id": "a", "error": "E"}\n')
    assert cli.main(["batch", str(inp), str(out)]) == 1  # a's error stays; nothing to run
    assert "nothing to run" in capsys.readouterr().err
    assert cli.main(["batch", str(inp), str(out), "--retry-errors"]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert out.read_text() == '{"id": "a", "error": "E"}\n'  # left as it was


def test_a_stats_file_must_be_a_file_this_process_can_append_to(tmp_path):
    """What the front end's check of ``sfi.stats_file`` takes (the worker opens it for appending)."""
    from sfi_vllm.patches.config_check import appendable

    existing = tmp_path / "stats.jsonl"
    existing.write_text("")
    assert appendable(str(existing)) and appendable(str(tmp_path / "new.jsonl"))
    assert not appendable(str(tmp_path))  # a directory
    assert not appendable(str(existing / "stats.jsonl"))  # below a file
    assert not appendable(str(tmp_path / "newdir") + "/")  # a directory's name
    assert not appendable(str(tmp_path / "missing" / "stats.jsonl"))
