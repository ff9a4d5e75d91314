"""sfi-vllm: Slow-Fast Inference (arXiv 2603.12038) as a vLLM attention backend."""

from sfi_vllm import moved_modules as _moved_modules

__version__ = "0.1.0"

_moved_modules.install()
