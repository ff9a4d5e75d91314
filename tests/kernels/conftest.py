"""The Triton kernels against their plain-torch references. ``interpreter`` cases (small shapes,
float32/16) run on the CPU in Triton's interpreter and are skipped where CUDA is; ``gpu`` cases
(the full shapes, bf16/fp16) need CUDA and are skipped elsewhere (tests/conftest.py)."""

import importlib
import os
import pkgutil
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()


def _import_triton_interpreted() -> str | None:
    """Import Triton and every ``sfi_vllm.kernels`` module with ``TRITON_INTERPRET=1``, then put
    the variable back as it was. Returns why the interpreter cases cannot run, or None."""
    if "triton" in sys.modules:  # imported before this file: only its interpreter mode will do
        import triton.language as tl

        if type(tl.zeros).__name__ != "InterpretedFunction":
            return ("Triton was imported before tests/kernels/conftest.py without TRITON_INTERPRET=1; "
                    "run tests/kernels in a pytest process of its own, or with TRITON_INTERPRET=1")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "needs Triton (its interpreter runs the kernels on the CPU)"
        import sfi_vllm.kernels

        for info in pkgutil.iter_modules(sfi_vllm.kernels.__path__):
            importlib.import_module(f"{sfi_vllm.kernels.__name__}.{info.name}")
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return None


# Triton picks its interpreter at import (triton.language, each @triton.jit): without CUDA, import it here first.
NOT_INTERPRETED = _import_triton_interpreted() if INTERPRET else None


@pytest.fixture(autouse=True)
def _triton_interpreter(request, monkeypatch):
    if INTERPRET and request.node.get_closest_marker("interpreter"):
        if NOT_INTERPRETED:  # a wrong import order must not pass as a skip
            pytest.fail(NOT_INTERPRETED)
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read again while a kernel runs; unset after the test


def pytest_collection_modifyitems(config, items):
    reason = ("CUDA is here: the gpu cases run the kernels" if not INTERPRET
              else NOT_INTERPRETED if NOT_INTERPRETED and NOT_INTERPRETED.startswith("needs") else None)
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(pytest.mark.skip(reason=reason))
