"""Offline use on the CPU engine: ``sfi-vllm batch``, ``python -m sfi_vllm.tools.engine_job`` and the
README's Python snippet, each run as a user runs it (a fresh process, vLLM's default settings)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sfi_vllm.tools.batch import LineError, done_ids, parse_line

REPO = Path(__file__).resolve().parents[1]
SMALL_SFI = {"sinks": 4, "selected_tokens": 64, "recent_window": 64, "reuse_budget": 16, "min_gap": 4}


# --------------------------------------------------------------------------- no engine

def test_parse_native_and_openai_batch_lines():
    rid, req = parse_line('{"id": "a", "prompt": "hi", "sampling": {"max_tokens": 3}, "sfi": {"policy": "dense"}}', 1)
    assert rid == "a" and req.prompt == "hi" and req.sampling == {"max_tokens": 3} and req.sfi == {"policy": "dense"}
    # a JSON string under sfi holds the object, as extra_args["sfi"] may offline (native and body)
    for line in ({"id": "s", "prompt": "hi", "sfi": '{"policy": "dense"}'},
                 {"custom_id": "s", "body": {"prompt": "hi", "sfi": '{"policy": "dense"}'}}):
        assert parse_line(json.dumps(line), 1)[1].sfi == {"policy": "dense"}
    rid, req = parse_line('{"messages": [{"role": "user", "content": "x"}]}', 7)
    assert rid == "line-7" and req.messages[0]["content"] == "x"
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 5,
                     "temperature": 0, "vllm_xargs": {"sfi": {"selected_tokens": 32}}}}
    rid, req = parse_line(json.dumps(line), 2)
    assert rid == "c1" and req.sfi is None
    assert req.sampling == {"max_tokens": 5, "temperature": 0, "extra_args": {"sfi": {"selected_tokens": 32}}}
    # the forms the OpenAI API carries: flat sfi_* keys and one JSON string; other xargs pass through
    for xargs in ({"sfi_selected_tokens": 32, "sfi_selector_alpha": 1.0, "other": "v"},
                  {"sfi": '{"selected_tokens": 32, "selector": {"alpha": 1.0}}', "other": "v"}):
        body = {"messages": [{"role": "user", "content": "q"}], "vllm_xargs": xargs}
        _, req = parse_line(json.dumps({"custom_id": "c2", "body": body}), 3)
        # kept as written, so that a refusal names them as the server would
        assert req.sfi is None and req.sampling == {"extra_args": xargs}
    with pytest.raises(LineError) as e:
        parse_line(json.dumps({"custom_id": "c3", "body": {"prompt": "a", "vllm_xargs": {"sfi_polcy": 1}}}), 4)
    assert e.value.args[0] == "c3" and "sfi_polcy" in e.value.args[1]
    # keys beside the request's are ignored, as vLLM's run-batch ignores them
    rid, req = parse_line(json.dumps({"custom_id": "c4", "method": "POST", "url": "/v1/completions",
                                      "body": {"prompt": "a"}, "metadata": {"k": 1}}), 5)
    assert rid == "c4" and req.prompt == "a"
    assert parse_line(json.dumps({"id": "i5", "body": {"prompt": "a"}}), 6)[0] == "i5"  # id alone names it


@pytest.mark.parametrize("text, rid, msg", [
    ("{not json", "line-3", "not valid JSON"),
    ('["a"]', "line-3", "JSON object"),
    ('{"id": "x", "prompt": "a", "messages": []}', "x", "exactly one of prompt and messages"),
    ('{"id": "x"}', "x", "exactly one of prompt and messages"),
    ('{"id": "x", "prompt": "a", "temperature": 0}', "x", "temperature: Extra inputs are not permitted"),
    ('{"custom_id": "y", "body": {"prompt": "a", "stream": true}}', "y", "streaming"),
    # one completion per line: the output keeps one, so n > 1 is refused, not cut to the first
    ('{"id": "x", "prompt": "a", "sampling": {"n": 3}}', "x", "sampling.n must be 1 in a batch"),
    ('{"id": "x", "prompt": "a", "sampling": {"n": 0}}', "x", "sampling.n must be 1 in a batch (one completion per line); got 0"),
    ('{"custom_id": "y", "body": {"prompt": "a", "n": 2}}', "y", "body.n must be 1 in a batch"),
    # a run-batch line names its request by custom_id: an id beside it would name the output record
    # instead, so the two together are an error of the line
    ('{"id": "x", "custom_id": "y", "body": {"prompt": "a"}}', "x", "id and custom_id: give one"),
    ('{"id": "x", "custom_id": "y", "prompt": "a"}', "x", "id and custom_id: give one"),
    # SFI settings given in two places would be merged or one dropped: refused
    ('{"custom_id": "y", "body": {"prompt": "a", "sfi": {"sinks": 2}, "vllm_xargs": {"sfi_selected_tokens": 16}}}',
     "y", "given twice (body.sfi and body.vllm_xargs)"),
    ('{"id": "x", "prompt": "a", "sfi": {"sinks": 2}, "sampling": {"extra_args": {"sfi": {"sinks": 4}}}}',
     "x", "given twice (sfi and sampling.extra_args.sfi)"),
    # a JSON string under sfi must hold one object, each key once
    ('{"id": "x", "prompt": "a", "sfi": "{\\"sinks\\": 2"}', "x", "sfi: a JSON string here must hold an "
     "object of SFI settings; not valid JSON"),
    ('{"id": "x", "prompt": "a", "sfi": "[1]"}', "x", "must hold an object of SFI settings; it holds list '[1]'"),
    ('{"id": "x", "prompt": "a", "sfi": "{\\"sinks\\": 2, \\"sinks\\": 3}"}', "x", "the key 'sinks' is given twice"),
    ('{"custom_id": "y", "body": {"prompt": "a", "sfi": ""}}', "y", "not valid JSON"),
    # a misspelt SFI key in vllm_xargs is an error of the line, not passed on to extra_args
    ('{"custom_id": "y", "body": {"prompt": "a", "vllm_xargs": {"sfi.sinks": 2}}}', "y", "did you mean 'sfi_sinks'"),
    ('{"custom_id": "y", "body": {"prompt": "a", "vllm_xargs": {"sfi_selectd_tokens": 2}}}', "y",
     "did you mean 'sfi_selected_tokens'"),
    # a run-batch line without its body: the body is named, not the run-batch fields beside it
    ('{"custom_id": "y", "method": "POST", "url": "/v1/chat/completions"}', "y", "body: missing"),
])
def test_parse_errors_name_the_line(text, rid, msg):
    with pytest.raises(LineError) as e:
        parse_line(text, 3)
    assert e.value.args[0] == rid and msg in e.value.args[1]
    assert not e.value.args[1].startswith("line:")  # a check of the whole line names its fields itself


def test_done_ids_drops_a_cut_off_last_line_and_optionally_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x"}\n{"id": "b", "error": "bad"}\n{"id": "c", "te')
    assert done_ids(out) == {"a", "b"}
    assert out.read_text() == '{"id": "a", "text": "x"}\n{"id": "b", "error": "bad"}\n'
    assert done_ids(out, retry_errors=True) == {"a"}
    assert out.read_text() == '{"id": "a", "text": "x"}\n'
    assert done_ids(tmp_path / "none.jsonl") == set()

    # a line that is no record of ours is kept as it is (only the cut-off last line is dropped)
    out.write_text('notes\n{"id": "a", "text": "x"}\nnull\n{"id": "b", "te')
    assert done_ids(out) == {"a"} and out.read_text() == 'notes\n{"id": "a", "text": "x"}\nnull\n'


def test_batch_files_are_read_as_json_lines_and_checked_before_the_engine(tmp_path):
    from sfi_vllm.tools.batch import BatchFileError, earlier_error_ids, read_input_lines

    inp = tmp_path / "in.jsonl"
    # U+2028 is allowed raw in a JSON string: it does not end the line; a byte-order mark and CRLF go
    inp.write_bytes('\ufeff{"id": "a", "prompt": "first\u2028second"}\r\n\n{"id": "b", "prompt": "x"}\n'.encode())
    lines = read_input_lines(inp)
    assert [n for n, _ in lines] == [1, 3]
    assert parse_line(lines[0][1], 1)[1].prompt == "first\u2028second"
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    for args, needle in (((tmp_path / "latin1.jsonl",), "not UTF-8"), ((tmp_path / "none.jsonl",), "cannot read"),
                         ((inp, inp), "the output is the input"), ((inp, tmp_path), "the output is a directory")):
        with pytest.raises(BatchFileError, match=needle):
            read_input_lines(*args)
    # JSON that Python's parser refuses with other errors than JSONDecodeError is an error of its line
    for text in ('[' * 100_000 + ']' * 100_000, '{"id": "a", "prompt": "x", "n": ' + '9' * 5000 + '}'):
        with pytest.raises(LineError, match="not valid JSON"):
            parse_line(text, 7)
    # ... and so is an SFI settings string nested past the parser's depth
    sfi_deep = json.dumps({"custom_id": "d", "url": "/v1/completions",
                           "body": {"prompt": "a", "vllm_xargs": {"sfi": '{"a": ' * 5000 + "1" + "}" * 5000}}})
    with pytest.raises(LineError, match="not valid JSON") as e:
        parse_line(sfi_deep, 8)
    assert e.value.args[0] == "d"  # the line keeps its id
    deep = tmp_path / "deep.jsonl"
    deep.write_text('[' * 100_000 + ']' * 100_000 + '\n{"id": "b", "prompt": "x"}\n')
    assert [n for n, _ in read_input_lines(deep)] == [1, 2]
    # ids key the output and a resumed run: a repeated one stops the command, however it is given
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "prompt": "x"}\n{"custom_id": "b", "body": {"prompt": "y"}}\n'
                   '{"custom_id": "a", "body": {"prompt": "z"}}\nnot json\n{"id": "line-4", "prompt": "w"}\n'
                   '{"id": "b", "prompt": "v"}\n')
    with pytest.raises(BatchFileError, match=r"ids must be unique.*'a' \(lines 1, 3\), 'b' \(lines 2, 6\), "
                                             r"'line-4' \(lines 4, 5\)"):
        read_input_lines(dup)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "error": "bad"}\n{"id": "b", "text": "y"}\n')
    assert earlier_error_ids(out) == {"a"}


@pytest.mark.parametrize("body, needle", [
    (5, "body must be a JSON object"),
    ({"prompt": "a", "vllm_xargs": 5}, "vllm_xargs must be a JSON object"),
    ({"prompt": "a", "extra_args": "s", "vllm_xargs": {"k": 1}}, "extra_args must be a JSON object"),
    ({"messages": [{"role": "user", "content": "q"}], "response_format": {"type": "json_object"}},
     "response_format: not supported"),
])
def test_openai_lines_that_cannot_run_are_errors_of_the_line(body, needle):
    with pytest.raises(LineError, match=needle):
        parse_line(json.dumps({"custom_id": "c", "body": body}), 1)


def test_openai_fields_that_do_not_change_the_output_are_taken():
    body = {"messages": [{"role": "user", "content": "q"}], "user": "alice", "store": False, "n": None,
            "logprobs": True, "top_logprobs": 3, "max_tokens": 4}
    _, req = parse_line(json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": body}), 1)
    assert req.sampling == {"logprobs": 3, "max_tokens": 4}
    _, req = parse_line(json.dumps({"custom_id": "c", "body": {**body, "logprobs": False}}), 1)
    assert req.sampling == {"max_tokens": 4}
    with pytest.raises(LineError, match="a batch generates text"):
        parse_line(json.dumps({"custom_id": "c", "url": "/v1/embeddings", "body": {"input": "x"}}), 1)


def test_batch_command_refuses_bad_files_and_settings_before_loading(tmp_path, capsys):
    from sfi_vllm.tools import cli

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    assert cli.main(["batch", str(inp), str(inp)]) == 2
    assert "the output is the input" in capsys.readouterr().err
    assert cli.main(["batch", str(inp), str(tmp_path / "o.jsonl"), "--attention-backend", "dense",
                     "--sfi", '{"sinks": 2}']) == 2
    assert "leave them out" in capsys.readouterr().err
    assert cli.main(["batch", str(inp), str(tmp_path / "o.jsonl"), "--sfi", '{"sinks": 2, "sinks": 4}']) == 2
    assert "'sinks' is given twice" in capsys.readouterr().err
    # the engine flags are checked before the model is prepared (a missing directory is not reached)
    missing = str(tmp_path / "no-model")
    assert cli.main(["batch", str(inp), str(tmp_path / "o.jsonl"), "--model", missing]) == 2
    assert f"--model {missing}: no such directory" in capsys.readouterr().err
    assert cli.main(["batch", str(inp), str(tmp_path / "o.jsonl"), "--model", missing, "--engine-kwargs", "[1]"]) == 2
    assert "--engine-kwargs: must be a JSON object" in capsys.readouterr().err
    assert cli.main(["batch", str(inp), str(tmp_path / "o.jsonl"), "--model", missing,
                     "--speculative-config", '{"method": "draft_model"}']) == 2
    assert "only as sfi.mode lossless" in capsys.readouterr().err


def test_batch_with_nothing_left_to_run_loads_no_engine(tmp_path, capsys, monkeypatch):
    import vllm

    from sfi_vllm.tools import cli

    def no_engine(*a, **k):
        raise AssertionError("an engine was loaded")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "error": "E"}\n')
    missing = str(tmp_path / "no-model")  # not reached
    assert cli.main(["batch", str(inp), str(out), "--model", missing]) == 1  # b's error stays
    err = capsys.readouterr().err
    assert "nothing to run: all 2 requests" in err and "1 of them errors of an earlier run" in err
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "text": "2"}\n')
    assert cli.main(["batch", str(inp), str(out), "--model", missing]) == 0
    # with b's error retried, there is something to run: the model is then needed (and checked)
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "error": "E"}\n')
    capsys.readouterr()
    assert cli.main(["batch", str(inp), str(out), "--model", missing, "--retry-errors"]) == 2
    assert f"--model {missing}: no such directory" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(AssertionError, match="an engine was loaded"):
        cli.main(["batch", str(inp), str(out), "--model", str(model), "--retry-errors"])


def test_batch_gives_lossless_mode_the_model_as_its_own_drafter_unless_told_otherwise(tmp_path, capsys):
    from sfi_vllm.tools import cli

    def kwargs(*flags: str) -> dict:
        args = cli.build_parser().parse_args(["batch", "in.jsonl", "out.jsonl", *flags])
        return cli.batch_engine_kwargs(args, "/models/m", cli._batch_flags(args), cuda=False)

    lossless = kwargs("--sfi", '{"mode": "lossless"}')
    assert lossless["speculative_config"] == {"method": "draft_model", "model": "/models/m",
                                              "num_speculative_tokens": cli.LOSSLESS_DRAFTS}
    assert lossless["additional_config"] == {"sfi": {"mode": "lossless"}} and lossless["dtype"] == "float32"
    assert "the model drafts for itself" in capsys.readouterr().err
    given = {"method": "draft_model", "model": "/models/m", "num_speculative_tokens": 3}
    assert kwargs("--sfi", '{"mode": "lossless"}', "--speculative-config", json.dumps(given))[
        "speculative_config"] == given
    assert kwargs("--sfi", '{"mode": "lossless"}', "--engine-kwargs", json.dumps({"speculative_config": given}))[
        "speculative_config"] == given
    assert capsys.readouterr().err == ""  # given: nothing filled in, nothing said
    assert "speculative_config" not in kwargs() and "speculative_config" not in kwargs("--attention-backend", "dense")
    # vLLM's own speculative decoding under dense attention is passed on as it is
    assert kwargs("--attention-backend", "dense", "--speculative-config", json.dumps(given))["speculative_config"] == given
    with pytest.raises(cli.UsageError, match="given twice"):
        kwargs("--sfi", '{"mode": "lossless"}', "--speculative-config", "{}", "--engine-kwargs", '{"speculative_config": {}}')
    with pytest.raises(cli.UsageError, match="only as sfi.mode lossless"):
        kwargs("--speculative-config", json.dumps(given))  # the lossy mode
    # SFI settings inside --engine-kwargs count as --sfi's: the mode's defaults follow them, and
    # the other keys of additional_config are kept beside them
    inside = kwargs("--engine-kwargs", json.dumps({"additional_config": {"sfi": {"mode": "lossless"}, "other": 1}}))
    assert inside["additional_config"] == {"sfi": {"mode": "lossless"}, "other": 1}
    assert inside["speculative_config"]["num_speculative_tokens"] == cli.LOSSLESS_DRAFTS
    assert kwargs("--engine-kwargs", '{"additional_config": {"other": 1}}')["additional_config"] == {"sfi": {}, "other": 1}
    assert kwargs("--attention-backend", "dense", "--engine-kwargs", '{"additional_config": {"other": 1}}')[
        "additional_config"] == {"other": 1}
    with pytest.raises(cli.UsageError, match="given twice"):
        kwargs("--sfi", '{"sinks": 2}', "--engine-kwargs", '{"additional_config": {"sfi": {"sinks": 4}}}')
    with pytest.raises(cli.UsageError, match="leave them out"):
        kwargs("--attention-backend", "dense", "--engine-kwargs", '{"additional_config": {"sfi": {"sinks": 4}}}')
    with pytest.raises(cli.UsageError, match="only as sfi.mode lossless"):
        kwargs("--engine-kwargs", json.dumps({"additional_config": {"sfi": {"mode": "lossy"}}}),
               "--speculative-config", json.dumps(given))
    with pytest.raises(cli.UsageError, match="must be a JSON object"):
        kwargs("--engine-kwargs", '{"additional_config": {"sfi": 3}}')
    assert kwargs("--engine-kwargs", '{"additional_config": {"sfi": null}}')["additional_config"] == {"sfi": {}}
    with pytest.raises(cli.UsageError, match="use --attention-backend"):
        kwargs("--attention-backend", "dense", "--engine-kwargs", '{"attention_backend": "sfi"}')
    with pytest.raises(cli.UsageError, match="sfi or dense"):
        kwargs("--attention-backend", "FLASH_ATTN")
    from sfi_vllm.config import SFIConfigError

    with pytest.raises(SFIConfigError, match="recent_window"):
        kwargs("--engine-kwargs", '{"additional_config": {"sfi": {"recent_window": -1}}}')


def test_batch_sampling_takes_logit_bias_keys_as_token_ids():
    from sfi_vllm.tools.batch import token_id_keys

    assert token_id_keys({"12": 5.0, 7: -1}, "sampling.logit_bias") == {12: 5.0, 7: -1}
    with pytest.raises(ValueError, match=r"sampling.logit_bias: keys are token ids \(integers\); got 'yes'"):
        token_id_keys({"yes": 1}, "sampling.logit_bias")


def test_a_dense_batch_engine_runs_lines_without_their_sfi_settings(tmp_path, monkeypatch):
    """The same file through ``--attention-backend dense`` is the dense reference: lines that give
    SFI settings run without them (a dense ``vllm serve`` ignores them too) and are counted for the
    command's closing line; on an SFI engine a run-batch line's flat keys are checked as written."""
    from types import SimpleNamespace

    import sfi_vllm.tools.batch as batch

    lines = [{"id": "plain", "prompt": "a"},
             {"id": "native", "prompt": "b", "sfi": {"recent_window": 0}},
             {"custom_id": "openai", "body": {"prompt": "c", "vllm_xargs": {"sfi_selected_tokens": 10 ** 6}}},
             # refused by SamplingParams: not submitted, so not counted
             {"id": "bad-sampling", "prompt": "d", "sfi": {"sinks": 2}, "sampling": {"temperature": -1}},
             # a field SamplingParams does not have: named by its path, with the nearest field
             {"id": "typo", "prompt": "e", "sampling": {"max_token": 5}},
             {"custom_id": "body-typo", "body": {"prompt": "f", "top_kk": 3}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    seen = {}

    def fake_run_requests(llm, requests, on_done, total, max_open, progress):
        for r in requests:
            if isinstance(r, dict):
                on_done(r)
            else:
                seen[r.id] = r.params
        return {"requests": len(lines), "errors": 0}

    def fake_llm(backend):
        return SimpleNamespace(model_config=SimpleNamespace(get_diff_sampling_param=lambda: {}),
                               llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
                                   attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)))))

    monkeypatch.setattr(batch, "run_requests", fake_run_requests)
    t = batch.run_batch(src, tmp_path / "dense.jsonl", fake_llm("FLASH_ATTN"), progress=False)
    assert sorted(seen) == ["native", "openai", "plain"] and t["sfi_settings_unused"] == 2
    refused, typo, body_typo = map(json.loads, (tmp_path / "dense.jsonl").read_text().splitlines())
    assert refused["id"] == "bad-sampling" and "temperature" in refused["error"]
    assert refused["error"].split()[0] != "VLLMValidationError:", refused  # the message alone, as the others
    assert typo == {"id": "typo", "line": 5, "error": "sampling.max_token: not a field of vLLM's SamplingParams; "
                    "did you mean 'max_tokens'?"}, typo
    assert body_typo["error"] == "body.top_kk: not a field of vLLM's SamplingParams; did you mean 'top_k'?", body_typo

    class Refusing:
        def request_config(self, extra_args):
            from sfi_vllm.config import build_config
            from sfi_vllm.request_config import EngineLimits, mapping_name, resolve_request_config
            limits = EngineLimits(cfg=build_config({}, use_env=False), max_model_len=4096, has_boundary=True)
            return resolve_request_config(limits, extra_args, mapping_where=mapping_name(extra_args))
    seen.clear()
    monkeypatch.setattr("sfi_vllm.controller.current_controller", lambda: Refusing())
    t = batch.run_batch(src, tmp_path / "sfi.jsonl", fake_llm("CUSTOM"), progress=False)
    errors = {r["id"]: r["error"] for r in map(json.loads, (tmp_path / "sfi.jsonl").read_text().splitlines())}
    assert sorted(seen) == ["plain"] and t["sfi_settings_unused"] == 0
    assert "extra_args.sfi.recent_window" in errors["native"] and "temperature" in errors["bad-sampling"], errors
    assert errors["openai"].startswith("vllm_xargs.sfi_selected_tokens:"), errors


# --------------------------------------------------------------------------- engines

@pytest.fixture(scope="module")
def model_dir() -> str:
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=False))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", **extra)
    return env


@pytest.mark.engine
def test_batch_command(model_dir, tmp_path):
    """A handful of lines, some bad: every line gets one output line, the bad ones an error, the
    run goes on; an id already in the output is not run again."""
    from transformers import AutoTokenizer

    greedy = {"temperature": 0, "max_tokens": 6}
    (yes,) = AutoTokenizer.from_pretrained(model_dir).encode(" yes")
    lines = [
        {"id": "prompt", "prompt": "One, two, three, four,", "sampling": greedy},
        {"id": "chat-dense", "messages": [{"role": "user", "content": "Say hello."}], "sampling": greedy,
         "sfi": {"policy": "dense"}},
        "{this line is not JSON",
        {"id": "bad-sfi", "prompt": "x", "sfi": {"recent_window": 0}},
        {"id": "bad-sampling", "prompt": "x", "sampling": {"temperature": -1}},
        {"id": "too-long", "prompt": "word " * 1500, "sampling": greedy},
        {"id": "too-long-chat", "messages": [{"role": "user", "content": "word " * 1500}], "sampling": greedy},
        {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}],
                  "max_tokens": 6, "temperature": 0}},
        {"id": "done-before", "prompt": "never run again"},
        # JSON object keys are strings; the token id's bias makes every token that token
        {"id": "bias", "prompt": "One, two, three, four,", "sampling": {**greedy, "logit_bias": {str(yes): 100}}},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    out.write_text('{"id": "done-before", "text": "from an earlier run"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "sfi_vllm.tools.cli", "batch", str(src), str(out), "--model", model_dir,
         "--max-model-len", "1024", "--max-num-seqs", "4", "--sfi", json.dumps(SMALL_SFI),
         "--engine-kwargs", '{"enforce_eager": true}'],  # no torch.compile: about 90 s less on 2 cores
        capture_output=True, text=True, timeout=400, env=_env())
    assert proc.returncode == 1, proc.stderr[-4000:]  # some lines failed
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == sorted(["prompt", "chat-dense", "line-3", "bad-sfi", "bad-sampling", "too-long",
                                   "too-long-chat", "openai", "done-before", "bias"]), recs
    assert recs["done-before"] == {"id": "done-before", "text": "from an earlier run"}
    assert recs["bias"].get("error") is None and recs["bias"]["text"] == " yes" * 6, recs["bias"]
    for rid in ("prompt", "chat-dense", "openai"):
        r = recs[rid]
        assert r.get("error") is None and r["completion_tokens"] == 6 and r["text"], r
    assert recs["prompt"]["sfi_stats"]["policy"] == "sfi" and recs["prompt"]["sfi_stats"]["decode_steps"] >= 5
    assert recs["chat-dense"]["sfi_stats"]["policy"] == "dense"
    assert "not valid JSON" in recs["line-3"]["error"] and recs["line-3"]["line"] == 3
    assert "sfi.recent_window" in recs["bad-sfi"]["error"]
    assert "temperature" in recs["bad-sampling"]["error"]
    n_long = len(AutoTokenizer.from_pretrained(model_dir).encode("word " * 1500))
    assert recs["too-long"]["error"].startswith(f"the prompt has {n_long} tokens, more than max_model_len (1024):")
    assert recs["too-long"]["line"] == 6  # refused by the engine at submission, named by its line too
    chat_long = re.match(r"the prompt has (\d+) tokens, more than max_model_len \(1024\):", recs["too-long-chat"]["error"])
    assert chat_long and int(chat_long.group(1)) > 1500, recs["too-long-chat"]
    assert re.search(r"tok/s", proc.stderr) and "9 requests written" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_engine_jobs_import_the_installed_package_from_any_working_directory(tmp_path, monkeypatch):
    """An engine job runs ``python -m sfi_vllm.tools.engine_job``, which puts the working directory
    first on sys.path: from a folder that holds another copy of sfi_vllm (an old clone) the job
    imported that copy. The job's environment keeps the working directory off the path."""
    from sfi_vllm.tools import engine_job

    seen = {}

    class Stop(Exception):
        pass

    def fake_run(cmd, env, **kwargs):
        seen.update(cmd=cmd, env=env)
        raise Stop  # before the engine

    monkeypatch.setattr(engine_job.subprocess, "run", fake_run)
    with pytest.raises(Stop):
        engine_job.run_engine_job(engine_job.EngineJob(model="m", prompts=["x"]))
    monkeypatch.undo()  # the module's subprocess is everyone's
    shadow = tmp_path / "sfi_vllm"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('a shadow copy of sfi_vllm')\n")
    (shadow / "version.py").write_text("")
    probe = [seen["cmd"][0], "-m", "sfi_vllm.version"]  # the job's interpreter and form, a light module
    proc = subprocess.run(probe, env=seen["env"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = subprocess.run(probe, env={k: v for k, v in seen["env"].items() if k != "PYTHONSAFEPATH"},
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "a shadow copy of sfi_vllm" in plain.stderr  # what the setting prevents


@pytest.mark.engine
def test_engine_job_module_runs_with_vllms_default_multiprocessing(model_dir, tmp_path):
    job = dict(model=model_dir, prompts=["Say hello."], max_tokens=4, attention_backend="sfi", sfi=SMALL_SFI,
               engine_kwargs=dict(dtype="float32", max_model_len=1024, max_num_seqs=2))
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.engine_job", str(tmp_path / "job.json"),
                           str(tmp_path / "res.json")], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "res.json").read_text())
    (out,) = res["outputs"]
    assert len(out["token_ids"]) == 4 and res["sfi_stats"][out["request_id"]]["decode_steps"] == 3


def readme_python_snippet() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no ```python block"
    return blocks[0]


@pytest.mark.engine
def test_readme_python_snippet_runs_as_a_script(model_dir, tmp_path):
    script = tmp_path / "snippet.py"
    snippet = readme_python_snippet()
    # as written, but eager: torch.compile on 2 CPU cores adds about 90 s and is not what this checks
    assert 'attention_backend="sfi"' in snippet
    script.write_text(snippet.replace('attention_backend="sfi"', 'attention_backend="sfi", enforce_eager=True'))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip(), "the snippet printed no generated text"


@pytest.mark.engine
def test_demo_ends_with_a_verdict(model_dir):
    proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.cli", "demo", "--prompts", "1", "--prompt-tokens", "400",
                           "--max-tokens", "12"], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"agreement with dense: \d+\.\d% teacher-forced top-1 \(\d+ of 11 decode steps\)", out), out
    assert re.search(r"a fast step read \d+ of \d+ context tokens", out) or "0 fast" in out, out
    assert re.search(r"slow steps: \d+ of 11 decode steps", out), out
    assert "Verdict: SFI chose dense's next token" in out and "GPU matter" in out
    # the GPU figure it cites is in the results file it names
    cited = re.search(r"decoded (\S+) as fast as dense attention \(([^()]+\.md)\)", out)
    assert cited and cited.group(1) in Path(cited.group(2)).read_text(), out
    assert re.search(r"dense: .*tok/s", proc.stderr), "no progress bar"
    assert "leaked" not in proc.stderr


def test_demo_stats_line_without_fast_steps_and_results_links(monkeypatch, tmp_path):
    """A demo whose every decode step was dense or slow (--max-tokens within the bridge) says so
    instead of a share of 0% read; a results file outside the checkout (an installed wheel) is
    named with where it is."""
    from sfi_vllm.tools import demo

    st = dict(slow_reasons={"first_decode": 1}, mean_attended_per_fast_step=0.0, mean_context_per_fast_step=0.0,
              attended_fraction=0.0, slow_steps=1, decode_steps=9, fast_steps=0, dense_steps=8)
    assert "attended: no fast steps (every decode step was dense or slow" in demo.format_stats(st)
    st.update(fast_steps=3, decode_steps=12, mean_attended_per_fast_step=50.0, mean_context_per_fast_step=400.0,
              attended_fraction=0.125)
    assert "a fast step read 50 of 400 context tokens per layer and KV head (12.5%)" in demo.format_stats(st)
    assert Path(demo.gpu_result_link()).is_file()  # this checkout has it
    assert demo.gpu_result_link("benchmarks/results/none.md") == \
        "benchmarks/results/none.md in sfi-vllm's source repository"


def test_demo_lossless_verdict_line_and_engine(monkeypatch):
    """``sfi-vllm demo --lossless``: each request's line says whether the output is dense's and how
    many drafts were kept; the second engine is the demo's working set in sfi.mode lossless with
    the model as its own drafter; the GPU figures the closing line cites are in their results file."""
    from sfi_vllm.config import SFIConfigError
    from sfi_vllm.tools import cli, demo

    ids = [5, 6, 7]
    st = {"verify_steps": 2, "accepted_tokens": 7, "drafted_tokens": 16, "acceptance_length": 4.5}
    assert demo.lossless_line(ids, {"token_ids": ids}, st) == (
        "  lossless: dense's tokens, all 3; 4.50 tokens per verify (7 of 16 drafts kept in 2 verify steps)")
    none = {"verify_steps": 0, "accepted_tokens": 0, "drafted_tokens": 0, "acceptance_length": 0.0}
    parted = demo.lossless_line(ids, {"token_ids": [5, 9, 7]}, none)
    assert "parts from dense's at token 1 of 3" in parted and "no drafts were verified" in parted
    reqs = [dict(dense={"token_ids": ids}, lossless={"token_ids": ids}, lossless_stats=st),
            dict(dense={"token_ids": ids}, lossless={"token_ids": [5, 9, 7]}, lossless_stats=dict(st, accepted_tokens=3))]
    assert demo.lossless_summary(reqs) == dict(identical=1, requests=2, verify_steps=4, drafted=32, accepted=10,
                                               tokens_per_verify=3.5)
    assert demo.lossless_summary([dict(reqs[0], lossless_stats=none)])["tokens_per_verify"] is None
    seen = {}

    def fake_job(job, env=None):
        seen["job"], seen["env"] = job, env
        return {"outputs": []}

    monkeypatch.setattr("sfi_vllm.tools.engine_job.run_engine_job", fake_job)
    demo.run_lossless("/m", ["p"], 12, {"sinks": 4, "mode": "lossy"}, {"max_model_len": 512})
    job = seen["job"]
    assert job.attention_backend == "sfi" and job.sfi == {"sinks": 4, "mode": "lossless"}
    assert job.engine_kwargs == {"max_model_len": 512, "speculative_config": {
        "method": "draft_model", "model": "/m", "num_speculative_tokens": cli.LOSSLESS_DRAFTS}}
    assert "VLLM_CPU_KVCACHE_SPACE" in seen["env"]
    text = (Path(__file__).resolve().parents[1] / demo.LOSSLESS_GPU_RESULT_FILE).read_text()
    for figure in ("1.30-1.34x", "2.12x", "6.9", "5.9", "7%", "1.8%"):
        assert figure in demo.LOSSLESS_GPU_RESULT and figure in text, figure
    with pytest.raises(SFIConfigError, match="refresh_overlap"):  # a setting the lossless mode refuses, before anything loads
        demo.run_demo(sfi={"refresh_overlap": True}, lossless=True)
    assert cli.build_parser().parse_args(["demo", "--lossless"]).lossless
