"""What planning a decode step costs the host: ``SFIController.plan_step`` + ``end_step``.

    python3 benchmarks/plan_cost.py [--batches 1,16,128] [--profile 128]

No vLLM engine and no GPU: a controller built from a minimal engine config (the ``balanced``
preset, the lagged token reader that a GPU engine uses, a one-token boundary vocabulary) plans
steady decode steps, every row past its first selection, as vLLM's model runner would call it
before each forward pass. Prints the mean per step over 300 steps (after 100 warm-up steps) per
batch size; ``--profile B`` adds cProfile's top functions at batch B; ``--balanced-splits`` also
makes each step's split table of ``balanced_splits`` (8 KV heads), as the CUDA metadata builder
does for every uniform step with the engine's default settings: without it the figure is that of
``balanced_splits: false``. Under vLLM's async
scheduling this host time overlaps the previous step's device time; where it is longer (small
models, large batches) it sets the step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from types import SimpleNamespace

import numpy as np
import torch


def controller(batch: int):
    from sfi_vllm.config import build_config
    from sfi_vllm.controller import SFIController

    sfi = {"preset": "balanced", "boundary_read": "lagged", "boundary_token_ids": [7]}
    vllm_config = SimpleNamespace(
        additional_config={"sfi": sfi},
        scheduler_config=SimpleNamespace(max_num_seqs=max(batch, 2)),
        model_config=SimpleNamespace(get_vocab_size=lambda: 16, skip_tokenizer_init=True, dtype=torch.bfloat16,
                                     get_num_layers=lambda parallel: 1, get_num_kv_heads=lambda parallel: 8,
                                     get_head_size=lambda: 128),
        parallel_config=SimpleNamespace(rank=0),
    )
    return SFIController(build_config(sfi, use_env=False), vllm_config)


def planner(batch: int, balanced_splits: bool = False):
    """A function that plans and ends one decode step of ``batch`` rows at growing contexts."""
    from sfi_vllm.backends.common import balanced_split_table

    ctl = controller(batch)
    ids = [f"req{i}-0123abcd" for i in range(batch)]
    prompts = [8000 + i for i in range(batch)]
    tokens = torch.full((batch,), 3, dtype=torch.int64)
    ctl.plan_step(ids, np.array(prompts), np.zeros(batch, dtype=np.int64), prompts, tokens)  # the prefill
    ctl.end_step()
    computed = np.array(prompts)
    ones = np.ones(batch, dtype=np.int64)

    def step():
        nonlocal computed
        plan = ctl.plan_step(ids, ones, computed, prompts, tokens)
        if balanced_splits:
            balanced_split_table(plan, batch, max(batch, 2), 8)
        ctl.end_step()
        computed = computed + 1

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", type=int, default=None, metavar="B", help="cProfile the steps at batch B")
    ap.add_argument("--balanced-splits", action="store_true",
                    help="also make each step's split table of balanced_splits")
    args = ap.parse_args()
    for batch in map(int, args.batches.split(",")):
        step = planner(batch, args.balanced_splits)
        for _ in range(100):
            step()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        per_step = (time.perf_counter() - start) / args.steps
        what = " + balanced split table" if args.balanced_splits else ""
        print(f"batch {batch}: {per_step * 1e6:.0f} us per plan_step{what} + end_step", flush=True)
        if args.profile == batch:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
