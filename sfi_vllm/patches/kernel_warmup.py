"""Compile SFI's eager-path kernels at start-up (:mod:`sfi_vllm.backends.kernel_warmup`), inside
vLLM's own kernel warm-up.

Why a patch: vLLM 0.26 compiles and tunes its own JIT kernels in ``kernel_warmup(worker)``, which
``Worker.compile_or_warm_up_model`` calls after the KV cache is bound and before the CUDA-graph
capture (vLLM's JIT monitor, which logs every later compilation as a latency spike, starts after
both). Attention backends get no warm-up hook of their own.

Patched (vLLM 0.26.0, the CUDA worker ``vllm.v1.worker.gpu_worker``): its module-level name
``kernel_warmup``, wrapped so that vLLM's warm-up runs first and SFI's follows, for the first SFI
layer of the worker's model that runs the Triton kernels. A failure is logged as a warning, per
configuration (those kernels then compile when first used, one pause each), and start-up goes on.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sfi_vllm")
_INSTALLED = False


def sfi_kernel_layer(vllm_config):
    """``(impl, kv_cache)`` of the first attention layer whose SFI work runs the Triton kernels
    (a :class:`~sfi_vllm.backends.packed_layer.PackedSFILayer`) and whose KV cache is bound; None
    if there is none (``sfi.kernels: torch``, a CPU engine, no cache yet)."""
    from sfi_vllm.backends.common import SFIImplMixin
    from sfi_vllm.backends.packed_layer import PackedSFILayer

    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for layer in context.values():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, SFIImplMixin) or not isinstance(getattr(impl, "sfi", None), PackedSFILayer):
            continue
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if kv is None or kv.numel() == 0 or not kv.is_cuda:
            continue
        return impl, kv
    return None


def warm_up_worker(worker) -> list[str] | None:
    """SFI's start-up compilation for ``worker`` (module doc). Returns what it launched, or None
    when it did not run."""
    from sfi_vllm.backends.kernel_warmup import warm_up_layer
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    found = sfi_kernel_layer(getattr(worker, "vllm_config", None))
    if ctl is None or found is None:
        return None
    impl, kv = found
    try:
        done, failed, seconds = warm_up_layer(impl, kv, ctl.cfg)
    except Exception as e:  # start-up goes on: the kernels compile when first used instead
        logger.warning("sfi-vllm: compiling the eager path's kernels at start-up failed (%s: %s); each will "
                       "compile when first used, a pause of about a second", type(e).__name__, e)
        return None
    for entry in failed:
        logger.warning("sfi-vllm: compiling an eager-path kernel at start-up failed (%s); it will compile when "
                       "first used, a pause of about a second", entry)
    logger.info("sfi-vllm: compiled the eager path's kernels at start-up (%d configurations, %d failed, %.1f s)",
                len(done), len(failed), seconds)
    return done


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    import vllm.v1.worker.gpu_worker as gpu_worker

    original = gpu_worker.kernel_warmup

    @functools.wraps(original)
    def kernel_warmup(worker):
        original(worker)
        warm_up_worker(worker)

    gpu_worker.kernel_warmup = kernel_warmup
    _INSTALLED = True
