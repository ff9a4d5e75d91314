"""How many sequences get a compact set: the pool of compact-buffer slots and its memory budget.

On the GPU kernel path the compact sets live in buffers allocated when the model is built
(``PackedCompactBuffer``), so vLLM's memory profiling subtracts them from the KV cache. One
sequence's set costs, over all layers,

    2 (K, V) x sets x layers x kv_heads x (sinks + K at max_model_len) x head_size x dtype bytes

(``sets`` = 2 with ``side_stream``, double-buffered, else 1). Sized for every one of vLLM's
``max_num_seqs`` (1024 by default on a GPU) this reaches tens of GiB (SmolLM2-135M at K 2048:
90 GiB). So the pool holds as many slots as a budget allows, at most ``max_num_seqs``:

* ``compact_memory_gib`` given: that many GiB;
* not given, on a GPU: ``COMPACT_AUTO_FRACTION`` of the GPU's memory;
* not given, on the CPU: every sequence (the CPU reference path allocates a set per live
  request, not up front).

A request that needs a compact set when every slot is taken runs with dense attention until it
finishes (or is preempted and comes back): logged, recorded in its statistics (``fallback``:
``compact_pool_full``) and counted in ``sfi_request_fallbacks_total``. Dense, not queued: vLLM's
scheduler admits requests by KV blocks alone, so holding one back would need a scheduler of our
own, while a dense request is served correctly, only without SFI's speed-up.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
# share of the GPU's memory the compact pool takes when no compact_memory_gib is given
COMPACT_AUTO_FRACTION = 0.10


@dataclass(frozen=True)
class CompactPool:
    slots: int  # sequences that can hold a compact set at once
    max_num_seqs: int
    bytes_per_slot: int  # over all layers
    budget_bytes: int | None  # None: every sequence (no budget)
    source: str  # "compact_memory_gib", "auto" (share of the GPU), "every sequence"

    @property
    def total_bytes(self) -> int:
        return self.slots * self.bytes_per_slot

    def describe(self, sets: int, layers: int, kv_heads: int, capacity: int, head_size: int,
                 dtype_bytes: int) -> str:
        budget = ("no budget" if self.budget_bytes is None
                  else f"budget {self.budget_bytes / GiB:.2f} GiB ({self.source})")
        return (f"compact pool: {self.slots} of max_num_seqs {self.max_num_seqs} sequences, {budget}; "
                f"{self.bytes_per_slot / 2**20:.1f} MiB per sequence = 2 (K, V) x {sets} sets x {layers} layers x "
                f"{kv_heads} kv heads x {capacity} tokens x {head_size} x {dtype_bytes} bytes; "
                f"{self.total_bytes / GiB:.2f} GiB in all. A request that finds the pool full runs densely "
                "(sfi_request_fallbacks_total{reason=\"compact_pool_full\"})")


def compact_bytes_per_slot(layers: int, kv_heads: int, capacity: int, head_size: int, dtype_bytes: int,
                           double_buffer: bool) -> int:
    return 2 * (2 if double_buffer else 1) * layers * kv_heads * capacity * head_size * dtype_bytes


def pool_shape(cfg, vllm_config, packed: bool) -> dict:
    """The model's numbers a compact pool is sized from (the keyword arguments of
    :func:`compact_pool` but ``max_num_seqs`` and the budgets): ``packed``, the GPU kernels' packed
    buffers (double-buffered with ``sfi.side_stream``)."""
    import torch

    mc, parallel = vllm_config.model_config, vllm_config.parallel_config
    return dict(layers=int(mc.get_num_layers(parallel)), kv_heads=int(mc.get_num_kv_heads(parallel)),
                capacity=cfg.compact_capacity(int(mc.max_model_len)), head_size=int(mc.get_head_size()),
                dtype_bytes=torch.empty((), dtype=mc.dtype).element_size(),
                double_buffer=packed and cfg.side_stream)


def compact_pool(*, max_num_seqs: int, layers: int, kv_heads: int, capacity: int, head_size: int,
                 dtype_bytes: int, double_buffer: bool, compact_memory_gib: float | None,
                 device_bytes: int | None) -> CompactPool:
    """The pool for a model and engine (module doc). ``device_bytes``: the GPU's memory (None on
    the CPU). Raises ValueError when the budget holds no sequence's set."""
    per_slot = compact_bytes_per_slot(layers, kv_heads, capacity, head_size, dtype_bytes, double_buffer)
    if compact_memory_gib is not None:
        budget, source = int(compact_memory_gib * GiB), "compact_memory_gib"
    elif device_bytes is not None:
        budget, source = int(COMPACT_AUTO_FRACTION * device_bytes), f"auto: {COMPACT_AUTO_FRACTION:.0%} of the GPU"
    else:
        return CompactPool(max_num_seqs, max_num_seqs, per_slot, None, "every sequence")
    slots = min(max_num_seqs, budget // per_slot) if per_slot else max_num_seqs
    if slots < 1:
        raise ValueError(f"sfi.compact_memory_gib: a budget of {budget / GiB:.3f} GiB ({source}) holds no "
                         f"sequence's compact set ({per_slot / 2**20:.1f} MiB each: sinks + K = {capacity} "
                         "tokens); raise it or lower sfi.selected_tokens")
    return CompactPool(int(slots), max_num_seqs, per_slot, budget, source)
