#!/bin/bash
# The H200 quality sweep (issue 4), as run on the device machine from the repository root after
# ../shared/gpu/README.md's install (vLLM 0.26.0 in /tmp/site, the SmolLM2 GGUF in /tmp/sfi-model).
# The suite files were generated on the development machine (no GPU needed, deterministic):
#   sfi-vllm suite --contexts C --samples 300 --out .gpu-data/suite/suite-C.jsonl.xz   (C = 2048, 4096, 8192)
# and carried to the device. Usage: bash benchmarks/results/quality-h200.sh TIME_LIMIT_S ABLATION_SAMPLES
set -uo pipefail
. /tmp/sfi-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q-out}; mkdir -p "$OUT"
LIMIT=${1:-300}; ABL=${2:-20}
M=/tmp/sfi-smol
python3 -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, '| gpu', torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# 1. convert the GGUF in its own process (see ../shared/gpu/README.md)
t0=$(date +%s)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_smoke import convert; convert('/tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf', Path('$M'))" \
  > "$OUT/convert.log" 2>&1 || { echo "convert failed"; tail -30 "$OUT/convert.log"; exit 1; }
echo "converted in $(( $(date +%s) - t0 )) s"
# 2. the suite: 3 contexts in one engine, main policies on every sample, ablations on the first $ABL
# samples per task and context; chunks of 105 samples (5 per task x context) until the time limit
python3 -m sfi_vllm.cli eval --model $M --suite .gpu-data/suite/suite-2048.jsonl.xz,.gpu-data/suite/suite-4096.jsonl.xz,.gpu-data/suite/suite-8192.jsonl.xz --no-progress --contexts 2048,4096,8192 --samples 300 \
  --policies dense,streaming,snapkv,quest,sfi \
  --ablations sfi-no-prior,sfi-no-nms,sfi-no-exclusivity,sfi-interval,sfi-boundary --ablation-samples "$ABL" \
  --retentions 0.1,0.2 --chunk-samples 105 --time-limit "$LIMIT" --max-num-seqs 512 \
  --gpu-memory-utilization 0.85 --stream /tmp/q-stream.jsonl \
  --out "$OUT/quality-h200.jsonl" --raw "$OUT/quality-h200-raw.jsonl" 2>&1 | tee "$OUT/eval.log"
rc=${PIPESTATUS[0]}
echo "eval exit $rc"
[ "$rc" = 0 ] || { [ -f /tmp/q-stream.jsonl ] && xz -T0 -c /tmp/q-stream.jsonl > "$OUT/stream.jsonl.xz"; }
