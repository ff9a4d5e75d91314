import os

import pytest
import torch

# vLLM on 2 CPU cores: keep thread binding and KV-cache space predictable in every test process.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % max(0, (os.cpu_count() or 1) - 1))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
