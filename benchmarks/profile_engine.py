"""Profile SFI decode steps in a real vLLM engine on the GPU: where a slow step's time goes.

    python3 benchmarks/profile_engine.py --point 1x8192 [--tokens 24] [--sfi JSON] [--out DIR]

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on e2e_bench.py's Qwen3-4B-shaped
model serves one point with e2e_bench's SFI settings. After a prefill and a warm-up, three
generate calls of ``--tokens`` tokens run with e2e_bench's slow-step probe (a slow step every
other step): one timed plainly, one under cProfile (host time per Python function: the
``tottime`` and ``cumtime`` tables), one under torch.profiler (device time per kernel, host time
per op). Prints the tables; with ``--out`` also writes them to ``profile-engine-BxC.txt``.

``--trace`` (with ``--out``): two more profiled calls, one with vLLM's ``record_function`` scopes
and one with Python stacks, each exported as a gzipped Chrome trace (``trace-BxC-scopes.json.gz``,
``trace-BxC-stacks.json.gz``) and read by ``trace_gaps.py``: how much of the call the device
sat idle, and in which host code (stacks inflate Python time, so read that one's shares, not
its milliseconds). vLLM caches its scope setting when it opens its first scope, so with
``--trace`` the scopes are on from the start, in the timed calls too (a ``record_function`` with
no profiler running costs a few microseconds).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--point", default="1x8192", help="BATCHxCONTEXT")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per profiled generate call")
    ap.add_argument("--sfi", default=None, help="JSON overrides of the engine's SFI settings")
    ap.add_argument("--out", default=None, help="folder for profile-engine-BxC.txt")
    ap.add_argument("--spec", default=None, metavar="JSON",
                    help="sfi.mode lossless: speculative settings as e2e_bench.py --spec's")
    ap.add_argument("--profiled", choices=("probe", "plain"), default="probe",
                    help="the run under the profilers: the slow-step probe or the engine's own settings")
    ap.add_argument("--trace", action="store_true",
                    help="with --out: export Chrome traces and report the device's idle gaps")
    args = ap.parse_args()
    if args.trace:
        if not args.out:
            raise SystemExit("--trace needs --out")
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # read by vLLM when a scope is first opened

    import torch
    from vllm import LLM, SamplingParams

    from e2e_bench import PROBE, SFI, capture_sizes, make_model

    batch, context = (int(x) for x in args.point.split("x"))
    model = Path("/tmp/sfi-qwen3-4b-shape")
    make_model(model)
    sfi = {**SFI, **(json.loads(args.sfi) if args.sfi else {})}
    extra = {}
    if args.spec:
        from e2e_bench import SPEC_MODES

        over = SPEC_MODES["lossless"]
        sfi.update({**over, "experimental": {**sfi.get("experimental", {}), **over["experimental"]}})
        extra["speculative_config"] = {"method": "draft_model", "model": str(model),
                                       "rejection_sample_method": "synthetic", **json.loads(args.spec)}
    llm = LLM(**extra, model=str(model), skip_tokenizer_init=True, max_model_len=context + args.tokens + 64,
              max_num_seqs=max(batch, 1), enable_prefix_caching=True, seed=0, enforce_eager=False,
              gpu_memory_utilization=float(os.environ.get("SFI_BENCH_GPU_MEM", "0.9")),
              max_num_batched_tokens=16384,
              compilation_config={"cudagraph_capture_sizes": capture_sizes([batch], extra.get("speculative_config"))},
              attention_backend="sfi", additional_config={"sfi": sfi})
    g = torch.Generator().manual_seed(batch * 7 + context)
    prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (context,), generator=g).tolist()}
               for _ in range(batch)]
    probe = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, extra_args={"sfi": PROBE})
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    for params in (probe, plain, probe):  # warm-up: Triton compiles, selection graphs captured
        llm.generate(prompts, params, use_tqdm=False)

    lines = [f"# profile_engine.py --point {args.point} --tokens {args.tokens} sfi={json.dumps(sfi)}"]
    for name, params in (("probe (slow step every other step)", probe), ("engine settings", plain)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        lines.append(f"{name}: {args.tokens} tokens x {batch} in {time.perf_counter() - t:.3f} s")

    profiled = probe if args.profiled == "probe" else plain
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, profiled, use_tqdm=False)
    torch.cuda.synchronize()
    prof.disable()
    for key, n in (("tottime", 45), ("cumtime", 60)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
        lines.append(f"## cProfile, {args.profiled} run, by {key}\n" + s.getvalue())

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        llm.generate(prompts, profiled, use_tqdm=False)
        torch.cuda.synchronize()
    avg = tp.key_averages()
    lines.append(f"## torch.profiler, {args.profiled} run, by device time\n"
                 + avg.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    lines.append(f"## torch.profiler, {args.profiled} run, by host time\n"
                 + avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    if args.trace:
        import gzip
        import shutil

        from trace_gaps import report

        for kind, stacks in (("scopes", False), ("stacks", True)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as tp:
                llm.generate(prompts, profiled, use_tqdm=False)
                torch.cuda.synchronize()
            raw = Path(args.out) / f"trace-{args.point}-{kind}.json"
            raw.parent.mkdir(parents=True, exist_ok=True)
            tp.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            lines.append(f"## device idle gaps, {args.profiled} run, {kind}\n" + report(f"{raw}.gz"))
    text = "\n\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile-engine-{args.point}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
