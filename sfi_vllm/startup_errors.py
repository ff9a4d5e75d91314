"""Start-up errors of sfi-vllm as one message, without a Python traceback.

A bad SFI setting is found while vLLM builds its ``VllmConfig`` (:mod:`sfi_vllm.patches.config_check`).
``VllmConfig`` is a pydantic dataclass, so the :class:`~sfi_vllm.config.SFIConfigError` raised
there reaches the user wrapped in a pydantic ``ValidationError`` and below a long traceback through
vLLM's argument handling. The message itself already names every bad field on a line of its own;
the traceback says nothing a user can act on. :func:`startup_message` finds sfi-vllm's own error in
such an exception; :func:`install_excepthook` prints only that message for an exception nobody
caught (a ``vllm serve`` or ``python -m vllm.entrypoints.openai.api_server`` start-up), unless
tracebacks are asked for (:func:`tracebacks_wanted`). Everything else goes to the previous hook.
"""

from __future__ import annotations

import os
import sys
from typing import Any

DEBUG_ENV = "SFI_VLLM_DEBUG"


def _ours(exc: BaseException) -> bool:
    from sfi_vllm.config import SFIConfigError
    from sfi_vllm.patches.config_check import SFIStartupError
    from sfi_vllm.version import UnsupportedVLLMVersion

    return isinstance(exc, (SFIConfigError, SFIStartupError, UnsupportedVLLMVersion))


def startup_message(exc: BaseException) -> str | None:
    """The message of the sfi-vllm start-up error in ``exc`` (itself, inside a pydantic
    ``ValidationError``, or in its cause or context), or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if _ours(e):
            return str(e)
        errors = getattr(e, "errors", None)
        if callable(errors) and type(e).__name__ == "ValidationError":
            try:
                items = errors()
            except Exception:  # not pydantic's
                items = []
            for item in items:
                inner = (item.get("ctx") or {}).get("error")
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += [e.__cause__, e.__context__]
    return None


def tracebacks_wanted() -> bool:
    """``SFI_VLLM_DEBUG=1``, or vLLM's own log level at DEBUG."""
    return (os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")
            or os.environ.get("VLLM_LOGGING_LEVEL", "").strip().upper() == "DEBUG")


def report(exc: BaseException, prog: str = "sfi-vllm", traceback_hint: str | None = None) -> bool:
    """Print ``exc``'s sfi-vllm start-up message to stderr; False if it holds none.
    ``traceback_hint``: how to see the traceback (default: the environment variables)."""
    msg = startup_message(exc)
    if msg is None:
        return False
    print(msg if msg.startswith("sfi-vllm") else f"{prog}: {msg}", file=sys.stderr)  # named once
    hint = traceback_hint or f"set {DEBUG_ENV}=1 or VLLM_LOGGING_LEVEL=DEBUG"
    print(f"(traceback: {hint})", file=sys.stderr, flush=True)
    return True


_INSTALLED = False


def install_excepthook() -> None:
    """Print sfi-vllm's start-up errors without a traceback when nothing caught them (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if tracebacks_wanted() or not report(exc):
            previous(exc_type, exc, tb)

    sys.excepthook = hook
    _INSTALLED = True


class EngineOptionsRefused(ValueError):
    """vLLM or sfi-vllm refused an engine's options (:func:`startup_message`'s or
    :func:`vllm_options_refusal`'s line) in a process that builds the engine for a command
    (``sfi-vllm eval``, ``fidelity``, ``demo --lossless``): raised in the command's own process,
    to be printed as that line."""


def vllm_options_refusal(e: BaseException) -> str | None:
    """One line for engine options vLLM refused while building its configuration (a pydantic
    ``ValidationError`` of one of ``vllm.config``'s classes); None for any other error."""
    if type(e).__name__ != "ValidationError" or not callable(getattr(e, "errors", None)):
        return None
    import vllm.config

    title = getattr(e, "title", "")
    if not hasattr(vllm.config, title):  # not one of vLLM's configuration classes
        return None
    try:
        items = e.errors()
    except Exception:  # noqa: BLE001 - not pydantic's
        return None
    messages = []
    for item in items:
        # the field's path, without pydantic's names of union members (literal[...], is-instance[...])
        loc = ".".join(str(x) for x in item.get("loc", ()) if isinstance(x, int) or str(x).isidentifier())
        msg = " ".join(str(item.get("msg", "")).split())
        messages.append(f"{loc}: {msg}" if loc else msg)
    return f"vLLM refused the engine's options ({title}): " + "; ".join(m for m in messages if m)
