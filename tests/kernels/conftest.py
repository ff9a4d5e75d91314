"""The Triton kernels against their plain-torch references. ``interpreter`` cases (small shapes,
float32/16) run on the CPU in Triton's interpreter and are skipped where CUDA is; ``gpu`` cases
(the full shapes, bf16/fp16) need CUDA and are skipped elsewhere (tests/conftest.py)."""

import dataclasses
import importlib
import os
import pkgutil
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
# what the interpreter cases' uniform fast-step launches aim for (sfi_vllm.kernels.fast_decode.UNIFORM_TARGET_PROGRAMS)
INTERPRETER_TARGET_PROGRAMS = 48
# the interpreter cases' slow-step frame rounding (sfi_vllm.backends.selection.WIDTH_BUCKET)
INTERPRETER_WIDTH_BUCKET = 512
# ... and the page top-K's smallest tile of best pages (sfi_vllm.kernels.top_k_pages.MIN_PAGE_TILE)
INTERPRETER_MIN_PAGE_TILE = 32


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


def _interpreter_without_overflow_checks(monkeypatch) -> None:
    """Triton's interpreter computes an overflow check for every add, sub and mul of integers
    narrower than 64 bits (``sanitize_overflow``) but, as the GPU compiler, reports a failed one
    only with ``debug``, which its options leave off (Triton 3.9): the checks find nothing here and
    took up to a third of the interpreter's time in these tests. Left on where Triton has no such
    option."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        monkeypatch.setattr(builder, "options", dataclasses.replace(options, sanitize_overflow=False))


@pytest.fixture(autouse=True)
def _triton_interpreter(request, monkeypatch):
    if INTERPRET and request.node.get_closest_marker("interpreter"):
        if NOT_INTERPRETED:  # a wrong import order must not pass as a skip
            pytest.fail(NOT_INTERPRETED)
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read again while a kernel runs; unset after the test
        _interpreter_without_overflow_checks(monkeypatch)
        # uniform launches: 48 programs instead of a 132-SM GPU's 528 (4 splits at 4 rows of 3 KV
        # heads instead of 44, most of which would find no keys at these contexts)
        from sfi_vllm.kernels import fast_decode

        monkeypatch.setattr(fast_decode, "UNIFORM_TARGET_PROGRAMS", INTERPRETER_TARGET_PROGRAMS)
        # ... and balanced launches' grids at most 4x that (idle programs run one by one here too)
        monkeypatch.setattr(fast_decode, "BALANCED_MAX_PROGRAMS", 4 * INTERPRETER_TARGET_PROGRAMS)
        # slow-step frames in steps of 512 tokens instead of 2048: the interpreter cases' contexts
        # are a few hundred tokens, and every position of a frame is scored
        from sfi_vllm.backends import selection

        monkeypatch.setattr(selection, "WIDTH_BUCKET", INTERPRETER_WIDTH_BUCKET)
        # the page top-K's smallest tile of best pages: 32 instead of 256 (the interpreter's tl.sort
        # of a tile dominated these cases); a module that checks which tiles a GPU compiles keeps 256
        if not getattr(request.module, "KEEPS_GPU_PAGE_TILES", False):
            from sfi_vllm.kernels import top_k_pages

            monkeypatch.setattr(top_k_pages, "MIN_PAGE_TILE", INTERPRETER_MIN_PAGE_TILE)


def pytest_collection_modifyitems(config, items):
    reason = ("CUDA is here: the gpu cases run the kernels" if not INTERPRET
              else NOT_INTERPRETED if NOT_INTERPRETED and NOT_INTERPRETED.startswith("needs") else None)
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(pytest.mark.skip(reason=reason))
