"""SFIFlashBackend: SFI on vLLM 0.26's FlashAttention backend (CUDA, FA3 on Hopper).

Prefill, dense and slow rows run FlashAttention on the kernel rows' metadata (FA's KV layout and
prefill path are reused unchanged). Fast rows run the Triton fast-step kernel over preallocated
compact buffers filled by the Triton repack kernel (``sfi.kernels="auto"``/``"triton"``), or the
plain-torch reference (``"torch"``); the Selector runs in torch on the GPU. The backend declares no
CUDA-graph support (vLLM runs attention eagerly between piecewise graphs) and plans each step on
the host (one sync per step). A second-stream selector and full CUDA graphs are not done yet.

Compact-buffer memory, allocated per layer when the model is built (so vLLM's profiling counts it
before sizing the KV cache): ``2 x max_num_seqs x kv_heads x (sinks + K_max) x head_size x dtype
bytes``, logged at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from sfi_vllm.backends.common import (
    SFIBackendMixin,
    SFIBuilderMixin,
    SFIImplMixin,
    SFIStep,
)
from sfi_vllm.compact import PackedCompactBuffer
from sfi_vllm.paged_kv import PagedKV


logger = init_logger(__name__)


class SFIFlashBackend(SFIBackendMixin, FlashAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_impl_cls() -> type["SFIFlashImpl"]:
        return SFIFlashImpl

    @staticmethod
    def get_builder_cls() -> type["SFIFlashMetadataBuilder"]:
        return SFIFlashMetadataBuilder

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes


@dataclass
class SFIFlashMetadata(FlashAttentionMetadata):
    sfi: SFIStep | None = None


class SFIFlashMetadataBuilder(SFIBuilderMixin, FlashAttentionMetadataBuilder):
    metadata_cls = SFIFlashMetadata
    # Attention runs eagerly (piecewise graphs around it) until the fast path is graph-safe.
    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER


class SFIFlashImpl(SFIImplMixin, FlashAttentionImpl):
    def _packed_buffer(self, vllm_config, num_kv_heads: int, head_size: int) -> PackedCompactBuffer | None:
        from sfi_vllm.config import config_from_vllm

        cfg = config_from_vllm(vllm_config)
        if cfg.kernels == "torch":
            return None
        slots = int(vllm_config.scheduler_config.max_num_seqs)
        capacity = cfg.compact_capacity(int(vllm_config.model_config.max_model_len))
        dtype = vllm_config.model_config.dtype
        nbytes = PackedCompactBuffer.bytes_for(slots, num_kv_heads, capacity, head_size, dtype)
        logger.info_once(
            "sfi-vllm: compact buffers take 2 x %d seqs x %d kv heads x %d tokens x %d x %d bytes "
            "= %.1f MiB per layer", slots, num_kv_heads, capacity, head_size,
            torch.empty((), dtype=dtype).element_size(), nbytes / 2**20)
        return PackedCompactBuffer(slots, num_kv_heads, capacity, head_size, dtype,
                                   torch.device("cuda", torch.cuda.current_device()))

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        return PagedKV(kv_cache, "flash", self.head_size)
