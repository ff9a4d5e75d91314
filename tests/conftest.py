import os
from pathlib import Path

import pytest
import torch

# vLLM on 2 CPU cores: keep thread binding and KV-cache space predictable in every test process.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % max(0, (os.cpu_count() or 1) - 1))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def pytest_collection_modifyitems(config, items):
    # the modules that build engines first (stable): under xdist they are one unit of work,
    # started at once (see pytest_xdist_make_scheduler)
    items.sort(key=lambda item: _module_path(item.nodeid) not in ENGINE_MODULES)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _engine_modules() -> set[str]:
    """Test modules that build a real vLLM engine: those using the ``engine`` mark."""
    tests = Path(__file__).parent
    return {path.relative_to(tests.parent).as_posix() for path in tests.rglob("test_*.py")
            if "mark.engine" in path.read_text()}


ENGINE_MODULES = _engine_modules()


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def xdist_scope(nodeid: str) -> str:
    """The unit of work of a test under ``-n 2``: all engine modules together, else its module."""
    module = _module_path(nodeid)
    return "engine modules" if module in ENGINE_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2`` (the README's test command): the modules that build engines run in one
    worker, one after another in their order, so that no two engines share the 2 cores of this
    project's CI machine at once and a module's engine fixtures are built once; the other worker
    runs the other modules meanwhile (Triton's interpreter, unit tests), a module at a time.
    A scheduler of our own rather than ``--dist loadgroup`` with ``xdist_group`` marks: xdist 3.8
    groups by renaming ``item._nodeid``, which pytest 9 no longer reads (the marks group nothing)."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order: the engine modules first
    return EngineModulesTogether(config, log)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
