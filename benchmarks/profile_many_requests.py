"""Many short requests at once, offline: wall time and where the host's time goes (cProfile).

    python3 benchmarks/profile_many_requests.py MODEL {sfi,dense} OUT_DIR [--prompts 300] [--sfi JSON --tag T]

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine core's Python runs in
this process and cProfile sees it) with vLLM's defaults (CUDA graphs, torch.compile, chunked
prefill, prefix caching) and, for ``sfi``, ``--attention-backend sfi`` with the engine's default
SFI settings (with ``--sfi``, those settings over them, e.g. ``'{"dense_below_context": 8192}'``).
The load is ``serve_bench.sh smol``'s: random prompts of 2,304-6,912 token ids, 48
generated tokens each (greedy, ``ignore_eos``), all added at once. Three ``generate`` calls of
``--prompts`` prompts each, on prompts of their own (seeds 1, 2, 3, so none is prefix-cached): a
warm-up (compilations, graph captures), one timed plainly ("plain wall") and one under cProfile
("profiled wall"). Prints the two times and, for ``sfi``, how many requests found the
compact-set pool full (they ran densely), how the selection ran (replayed from a CUDA graph,
captured, eagerly), the SFI functions by cumulative time and what the step's end and the
attention layer call; writes
``MODE[TAG]-tottime.txt`` and ``MODE[TAG]-cumtime.txt`` (the whole profile's top functions) to
``OUT_DIR``.
cProfile slows Python down, so read its times as shares. Run each mode in a process of its own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompts(seed: int, n: int):
    from vllm.inputs import TokensPrompt

    r = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[r.randrange(100, 40000) for _ in range(r.randint(2304, 6912))])
            for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("mode", choices=("sfi", "dense"))
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--sfi", default=None, help="JSON: the SFI engine's settings over the defaults")
    ap.add_argument("--tag", default="", help="suffix of the output files' mode")
    args = ap.parse_args()
    if args.sfi and args.mode != "sfi":
        ap.error("--sfi sets the SFI engine's settings: give it with the sfi mode")
    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.mode == "sfi":
        kwargs = dict(attention_backend="sfi", additional_config={"sfi": json.loads(args.sfi or "{}")})
    llm = LLM(args.model, seed=0, **kwargs)
    name = args.mode + args.tag
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
    llm.generate(prompts(1, args.prompts), params, use_tqdm=False)
    batch = prompts(2, args.prompts)
    t = time.time()
    llm.generate(batch, params, use_tqdm=False)
    print(name, "plain wall", round(time.time() - t, 2), flush=True)
    batch = prompts(3, args.prompts)
    prof = cProfile.Profile()
    t = time.time()
    prof.enable()
    llm.generate(batch, params, use_tqdm=False)
    prof.disable()
    print(name, "profiled wall", round(time.time() - t, 2), flush=True)
    for key, n in (("tottime", 30), ("cumtime", 60)):
        f = io.StringIO()
        pstats.Stats(prof, stream=f).sort_stats(key).print_stats(n)
        with open(os.path.join(args.out, f"{name}-{key}.txt"), "w") as fh:
            fh.write(f.getvalue())
    if args.mode == "sfi":  # requests that found the compact-set pool full ran densely
        from sfi_vllm.controller import current_controller

        ctl = current_controller()
        print(name, "compact sets", ctl.compact_slots, "requests that found them taken (all calls)",
              ctl.pool_full_requests, flush=True)
        if ctl.executor is not None:  # how the selection ran, all calls: from a graph, captured, eagerly
            print(name, "selection runs (all calls)", ctl.executor.graph_runs(), flush=True)
        f = io.StringIO()
        stats = pstats.Stats(prof, stream=f).sort_stats("cumtime")
        stats.print_stats("sfi_vllm", 40)
        stats.print_callees(r"end_step|common.py:\d+\(forward\)")
        print(f.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
