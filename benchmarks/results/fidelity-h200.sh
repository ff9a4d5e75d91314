#!/bin/bash
# Teacher-forced fidelity on the H200 (`sfi-vllm fidelity`: 2K/4K/8K essays, each policy forced along
# dense attention's continuation; top-1 agreement and KL per step), in one device call.
# On the device machine, from the repository root, after the GPU install, with .gpu-data carried
# (.gpu-data/cache/texts holds the essay corpus; the device has no network):
#   OUT=$OUT bash benchmarks/results/fidelity-h200.sh [DOCS [TOKENS]]
# DOCS documents per context (default 12), TOKENS teacher-forced decode steps each (default 256);
# CONTEXTS=2048,4096 (env) runs a subset of the contexts (default 2048,4096,8192); POLICIES and
# RETENTIONS (env) as for `sfi-vllm fidelity` (defaults: dense, sfi, sfi-paper and the three
# baselines at 10% and 20%).
# MAX_NUM_SEQS (default 256) and COMPACT_GIB (default 25: sfi.compact_memory_gib, through
# $SFI_CONFIG): the pool must hold a set for each of MAX_NUM_SEQS requests (90 MiB each for
# SmolLM2 at the default K), or fidelity refuses to run (requests beyond it would run densely).
# One engine, three phases of TOKENS + 1 steps each (dense free-running; dense teacher-forced: the
# reference; every policy teacher-forced and free-running). Writes to $OUT: fidelity-h200.jsonl,
# fidelity-h200-raw.jsonl.xz, fidelity-h200.md, fidelity.log.
set -uo pipefail
. /tmp/sfi-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 SFI_VLLM_CACHE=$PWD/.gpu-data/cache
OUT=${OUT:-/tmp/f-out}; mkdir -p "$OUT"
DOCS=${1:-12}; T=${2:-256}; CONTEXTS=${CONTEXTS:-2048,4096,8192}
M=/tmp/sfi-smol
printf 'compact_memory_gib: %s\n' "${COMPACT_GIB:-25}" > /tmp/sfi-fidelity.yaml
export SFI_CONFIG=/tmp/sfi-fidelity.yaml
t_start=$(date +%s)
if [ ! -f $M/config.json ]; then
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_smoke import convert; convert('/tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf', Path('$M'))" \
    > "$OUT/convert.log" 2>&1 || { echo "convert failed"; tail -30 "$OUT/convert.log"; exit 1; }
  echo "converted in $(( $(date +%s) - t_start )) s"
fi
python3 -m sfi_vllm.tools.cli fidelity --model $M --contexts "$CONTEXTS" --docs "$DOCS" --tokens "$T" \
  --policies "${POLICIES:-dense,sfi,sfi-paper,streaming,snapkv,quest}" --retentions "${RETENTIONS:-0.1,0.2}" \
  --max-num-seqs "${MAX_NUM_SEQS:-256}" --gpu-memory-utilization 0.85 \
  --out "$OUT/fidelity-h200.jsonl" --raw /tmp/fidelity-h200-raw.jsonl --report "$OUT/fidelity-h200.md" \
  > "$OUT/fidelity.log" 2>&1
rc=$?
echo "fidelity exit $rc after $(( $(date +%s) - t_start )) s"
grep -v "^INFO\|^WARNING\|Loading safetensors" "$OUT/fidelity.log" | tail -60
[ -f /tmp/fidelity-h200-raw.jsonl ] && xz -T0 -c /tmp/fidelity-h200-raw.jsonl > "$OUT/fidelity-h200-raw.jsonl.xz"
echo "done after $(( $(date +%s) - t_start )) s"
