"""Triton kernels of sfi-vllm (installed as the package ``sfi_vllm_kernels``).

Each kernel's plain-torch reference lives in ``sfi_vllm/`` and is the spec; ``tests/`` compares
them (on the GPU, and on the CPU through Triton's interpreter where it allows).
"""
