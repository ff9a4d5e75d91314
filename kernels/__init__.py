"""Triton kernels of sfi-vllm: the package ``sfi_vllm.kernels`` (the link ``sfi_vllm/kernels`` points here).

Each kernel's plain-torch reference lives in ``sfi_vllm/`` and is the spec; ``tests/`` compares
them (on the GPU, and on the CPU through Triton's interpreter where it allows).
"""
