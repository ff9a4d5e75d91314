"""Minimal GPU check of the SFI backend through vLLM 0.26 (one SFI engine, a few prompts).

    python3 benchmarks/gpu_check.py --gguf /tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import json
from pathlib import Path

from gpu_smoke import SMALL, convert

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    args = ap.parse_args()
    model = Path("/tmp/sfi-smol")
    convert(args.gguf, model)
    from sfi_vllm.tools.engine_job import EngineJob, run_engine_job

    prompts = ["Write three sentences about the sea. " * 40, "Explain what a compiler does. " * 60]
    r = run_engine_job(EngineJob(model=str(model), prompts=prompts, max_tokens=48, attention_backend="sfi",
                                 sfi=SMALL, engine_kwargs=dict(max_model_len=4096, max_num_seqs=4)), timeout=300)
    for o in r["outputs"]:
        st = r["sfi_stats"][o["request_id"]]
        print(json.dumps({"text": o["text"][:120], "fast": st["fast_steps"], "slow": st["slow_steps"],
                          "attended_fraction": st["attended_fraction"]}))
