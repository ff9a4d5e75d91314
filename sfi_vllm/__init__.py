"""sfi-vllm: Slow-Fast Inference (arXiv 2603.12038) as a vLLM attention backend."""

__version__ = "0.1.0"
