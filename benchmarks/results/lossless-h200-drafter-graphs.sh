# Device side, one call after the GPU install (benchmarks/results/lossless-h200.md, part 4): SmolLM2 in
# sfi.mode lossless with drafter_graphs (the run used its earlier name, experimental.drafter_graphs), 4 requests, 3 generate calls; prints the wrappers'
# captures / replays / piecewise passes, the acceptance and the first tokens.
# after the GPU install, which writes /tmp/sfi-env.sh and unpacks the SmolLM2 GGUF in /tmp/sfi-model
. /tmp/sfi-env.sh && . benchmarks/device_env.sh
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_smoke import convert; convert('/tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf', Path('/tmp/sfi-smol'))" > /tmp/c.log 2>&1
VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 330 python3 - > $OUT/dg.log 2>&1 <<'PY'
import gc, json, time
from vllm import LLM, SamplingParams
m = "/tmp/sfi-smol"
sfi = {"mode": "lossless", "selected_tokens": 256, "recent_window": 64, "drafter_graphs": True}
llm = LLM(model=m, attention_backend="sfi", additional_config={"sfi": sfi}, max_model_len=4096, max_num_seqs=8,
          gpu_memory_utilization=0.5, speculative_config={"method": "draft_model", "model": m, "num_speculative_tokens": 4})
p = ["The history of the city of Rome begins with a small settlement on the Tiber. " * 60 + "Summarize it."] * 2
p += ["A long essay about the ocean, its currents and the life within it. " * 70 + "Continue the essay."] * 2
sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
for i in range(3):
    t = time.time(); outs = llm.generate(p, sp, use_tqdm=False); print("RUN", i, round(time.time() - t, 2), flush=True)
w = [o for o in gc.get_objects() if type(o).__name__ == "DrafterGraphs"]
print("WRAPPERS", [(x.captures, x.replays, x.piecewise, sorted(x.failed), sorted(x.warmed)) for x in w])
from sfi_vllm.controller import current_controller
st = [s.to_dict() for s in current_controller().stats.snapshot().values()]
print("ACCEPT", [s["acceptance_length"] for s in st][-4:])
print("TOKENS", [o.outputs[0].token_ids[:12] for o in outs])
PY
echo rc=$?; grep -E "RUN|WRAPPERS|ACCEPT|TOKENS|captured|drafter's|Traceback|Error" $OUT/dg.log | cut -c1-400 | head -30; tail -3 $OUT/dg.log | cut -c1-300
