"""sfi-vllm's start-up errors reach the user as their message, one line per bad field."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, model_validator

from sfi_vllm.config import SFIConfigError, build_config
from sfi_vllm.startup_errors import startup_message


class _LikeVllmConfig(BaseModel):
    """Stands in for vLLM's VllmConfig: a pydantic model whose validation raises our error."""

    sfi: dict

    @model_validator(mode="after")
    def _check(self):
        build_config(self.sfi, use_env=False)
        return self


def test_message_is_found_inside_pydantics_wrapper():
    with pytest.raises(Exception) as e:
        _LikeVllmConfig(sfi={"recent_window": 0, "sinks": -1})
    assert type(e.value).__name__ == "ValidationError"  # what vLLM's start-up raises
    msg = startup_message(e.value)
    assert msg is not None and msg.splitlines() == [
        "invalid SFI configuration:",
        "  sfi.sinks: Input should be greater than or equal to 0 (allowed: 0 <= value <= 4096); got -1",
        "  sfi.recent_window: Input should be greater than or equal to 1 (allowed: 1 <= value <= 1048576); got 0",
    ]


def test_other_errors_are_not_ours():
    assert startup_message(ValueError("x")) is None
    try:
        try:
            raise SFIConfigError("inner")
        except SFIConfigError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as e:
        assert startup_message(e) == "inner"


@pytest.mark.parametrize("debug", [False, True])
def test_cli_prints_one_line_per_field_without_traceback(debug):
    cmd = [sys.executable, "-m", "sfi_vllm.tools.cli", "config", "--sfi", '{"recent_window": 0}']
    proc = subprocess.run(cmd + (["--debug"] if debug else []), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "sfi.recent_window: Input should be greater than or equal to 1" in proc.stderr
    assert ("Traceback" in proc.stderr) == debug


def test_uncaught_error_prints_without_traceback_once_the_plugin_is_loaded():
    code = ("import sfi_vllm.plugin as p; p.register(); from sfi_vllm.config import build_config; "
            "build_config({'recent_window': 0}, use_env=False)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "sfi.recent_window" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
