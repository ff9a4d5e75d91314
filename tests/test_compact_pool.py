"""The compact-set pool (sfi_vllm.compact_pool): its size for real model shapes and GPUs, and what
the controller does when it is full (the request runs densely, recorded and counted)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sfi_vllm.compact_pool import COMPACT_AUTO_FRACTION, GiB, compact_bytes_per_slot, compact_pool
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController
from sfi_vllm.trigger import StepMode

H200 = int(139.8 * 2**30)  # total memory as torch reports it (as in test_config.py)
GPU_24G = 24 * GiB
# (layers, kv heads, head size), bf16
SMOLLM2 = (30, 3, 64)
QWEN3_4B = (36, 8, 128)


def pool(shape, device_bytes, gib=None, k=2048, max_num_seqs=1024, side_stream=True):
    layers, kv, d = shape
    return compact_pool(max_num_seqs=max_num_seqs, layers=layers, kv_heads=kv, capacity=4 + k, head_size=d,
                        dtype_bytes=2, double_buffer=side_stream, compact_memory_gib=gib, device_bytes=device_bytes)


def test_bytes_per_sequence_match_the_buffers_formula():
    # the CUDA log line: 2 (K, V) x 2 sets x 1024 seqs x 3 kv heads x 2052 tokens x 64 x 2 bytes = 3078.0 MiB per layer
    per_layer_1024 = compact_bytes_per_slot(1, 3, 2052, 64, 2, True) * 1024
    assert per_layer_1024 / 2**20 == pytest.approx(3078.0, abs=0.05)
    assert compact_bytes_per_slot(30, 3, 2052, 64, 2, True) == 30 * per_layer_1024 // 1024


@pytest.mark.parametrize("shape, device, slots", [
    (SMOLLM2, H200, 158),   # 13.98 GiB / 90.2 MiB
    (SMOLLM2, GPU_24G, 27),
    (QWEN3_4B, H200, 24),   # 13.98 GiB / 577.5 MiB
    (QWEN3_4B, GPU_24G, 4),
])
def test_auto_budget_is_a_tenth_of_the_gpu(shape, device, slots):
    p = pool(shape, device)
    assert p.budget_bytes == int(COMPACT_AUTO_FRACTION * device)
    assert p.slots == slots == p.budget_bytes // p.bytes_per_slot
    assert p.total_bytes <= p.budget_bytes < p.total_bytes + p.bytes_per_slot
    # against every one of vLLM's default 1024 sequences: SmolLM2 took 90 GiB of the H200 before
    assert p.total_bytes < 0.11 * device < 1024 * p.bytes_per_slot


def test_explicit_budget_and_its_limits():
    p = pool(QWEN3_4B, H200, gib=4.0)
    assert p.source == "compact_memory_gib" and p.slots == int(4 * GiB // p.bytes_per_slot) == 7
    assert pool(SMOLLM2, H200, gib=1000.0, max_num_seqs=64).slots == 64  # never more than max_num_seqs
    assert pool(SMOLLM2, None).slots == 1024 and pool(SMOLLM2, None).budget_bytes is None  # CPU: every sequence
    assert pool(SMOLLM2, None, gib=0.5).slots == 5  # an explicit budget applies on the CPU too
    with pytest.raises(ValueError, match="holds no sequence's compact set"):
        pool(QWEN3_4B, GPU_24G, gib=0.25)
    assert "158 of max_num_seqs 1024" in pool(SMOLLM2, H200).describe(2, 30, 3, 2052, 64, 2)


def _controller(slots_gib, n):
    sfi = {"boundary_token_ids": [7], "min_gap": 0, "selected_tokens": 32, "compact_memory_gib": slots_gib, "bridge_steps": 0}
    mc = SimpleNamespace(get_vocab_size=lambda: 16, skip_tokenizer_init=True, max_model_len=1024,
                         get_num_layers=lambda p: 30, get_num_kv_heads=lambda p: 3, get_head_size=lambda: 64,
                         dtype=torch.float32)
    vc = SimpleNamespace(additional_config={"sfi": sfi}, scheduler_config=SimpleNamespace(max_num_seqs=n),
                         model_config=mc, parallel_config=SimpleNamespace(rank=0))
    return SFIController(build_config(sfi, use_env=False), vc)


def test_a_full_pool_runs_the_request_densely_and_counts_it():
    per_seq = compact_bytes_per_slot(30, 3, 36, 64, 4, False)  # CPU: float32, one set
    from sfi_vllm.metrics import worker_metrics

    gauges = worker_metrics().compact_sets_in_use, worker_metrics().compact_sets
    for g in gauges:
        g.set(-1)  # whatever an earlier controller of this process left
    ctl = _controller(2.5 * per_seq / GiB, n=4)  # room for two compact sets
    assert ctl.compact_slots == 2
    assert [g._value.get() for g in gauges] == [0, 2]  # from start-up, before any step
    metric = ctl.stats.metrics.fallbacks.labels(reason="compact_pool_full")
    before = metric._value.get()
    dense = [{"sfi_policy": "dense"}]

    def step(reqs, extra=None):
        n = len(reqs)
        return ctl.plan_step(reqs, np.ones(n, int), np.full(n, 3000), [2900] * n, torch.full((n,), 3), extra)

    p = step(["d", "a", "b", "c"], dense + [None] * 3)  # a dense request takes no compact set
    assert p.modes == [StepMode.DENSE, StepMode.SLOW, StepMode.SLOW, StepMode.DENSE]
    assert ctl.slot_of["d"] >= 2 and {ctl.slot_of["a"], ctl.slot_of["b"]} == {0, 1}
    assert ctl.stats.get("c").fallback == "compact_pool_full" and ctl.stats.get("c").policy == "dense"
    assert metric._value.get() == before + 1
    metrics = ctl.stats.metrics

    def pool_gauges():
        ctl.end_step()  # written as the step ends
        return metrics.compact_sets_in_use._value.get(), metrics.compact_sets._value.get()

    assert pool_gauges() == (2, 2)

    class Out:
        finished_req_ids, preempted_req_ids = {"a"}, ()

    ctl.on_scheduler_output(Out())  # a's compact set is free again: the next request gets it
    p = step(["b", "c", "e"])
    assert p.modes[1] == StepMode.DENSE and p.modes[2] == StepMode.SLOW  # c stays dense until it ends
    assert ctl.slot_of["e"] < 2 and metric._value.get() == before + 1

    class Preempted:
        finished_req_ids, preempted_req_ids = {"b"}, {"c"}

    ctl.on_scheduler_output(Preempted())  # b's set is free, c gave its slot back: at its return c stays dense
    assert "c" not in ctl.slot_of and ctl.free_compact
    p = step(["c"])
    assert p.modes == [StepMode.DENSE] and ctl.slot_of["c"] >= 2 and ctl.free_compact
    assert ctl.stats.get("c").fallback == "compact_pool_full" and metric._value.get() == before + 1
    assert pool_gauges() == (1, 2)  # e's; c runs densely in a slot without a set

    class PreemptedAgain:
        finished_req_ids, preempted_req_ids = set(), {"c"}

    ctl.on_scheduler_output(PreemptedAgain())
    step(["x"], dense)  # a dense request takes the last slot without a compact set (d holds the other)
    assert not ctl.free_plain and ctl.free_compact
    p = step(["c"])  # back again: only compact sets are free, and it still runs densely
    assert p.modes == [StepMode.DENSE] and ctl.slot_of["c"] < 2
    assert ctl.stats.get("c").policy == "dense" and metric._value.get() == before + 1


def test_a_request_that_stays_below_dense_below_context_takes_no_compact_set():
    """A request whose context cannot reach dense_below_context before its last token (its prompt
    plus max_tokens, from the runner) decodes densely throughout: it takes a slot without a compact
    set, leaving the pool to requests that need one, and is no fallback. Unknown or longer: a set."""
    per_seq = compact_bytes_per_slot(30, 3, 36, 64, 4, False)
    ctl = _controller(2.5 * per_seq / GiB, n=5)  # two compact sets, three slots without
    assert ctl.compact_slots == 2
    short = {"sfi_dense_below_context": 4096}

    def step(reqs, max_lens, extra=None):
        n = len(reqs)
        return ctl.plan_step(reqs, np.ones(n, int), np.full(n, 3000), [2900] * n, torch.full((n,), 3),
                             extra or [short] * n, max_lens=max_lens)

    # 2900 + 1196 = 4096: the last decode step's context is 4095, below the setting
    p = step(["s", "t", "u", "v"], [3000, 4096, 4097, None])
    assert ctl.slot_of["s"] >= 2 and ctl.slot_of["t"] >= 2  # no set
    assert ctl.slot_of["u"] < 2 and ctl.slot_of["v"] < 2  # its context may pass 4096; unknown
    assert p.modes == [StepMode.DENSE] * 4  # every context (3001) is below the setting now
    assert all(ctl.stats.get(r).fallback is None for r in "stuv")
    # should a context pass prompt + max_tokens after all, the request without a set stays dense
    p = ctl.plan_step(["s"], np.ones(1, int), np.full(1, 5000), [2900], torch.full((1,), 3), [short])
    assert p.modes == [StepMode.DENSE] and ctl.stats.get("s").slow_steps == 0
    p = step(["w"], [3000], [None])  # the engine's dense_below_context (0): it needs a set, and none is free
    assert ctl.stats.get("w").fallback == "compact_pool_full" and p.modes == [StepMode.DENSE]


def test_the_shared_fake_engine_config_sizes_a_pool():
    """The GPU kernel tests build their controllers from ``fake_vllm_config``; on CUDA the controller
    sizes a compact pool from it, the path a CPU run with ``compact_memory_gib`` takes too."""
    from test_sfi_layer import fake_vllm_config

    sfi = {"compact_memory_gib": 1.0, "bridge_steps": 0, "boundary_token_ids": [7]}
    ctl = SFIController(build_config(sfi, use_env=False), fake_vllm_config(sfi, max_model_len=8192))
    assert ctl.compact_slots == 8  # 1 GiB holds far more than max_num_seqs sets of one small layer
