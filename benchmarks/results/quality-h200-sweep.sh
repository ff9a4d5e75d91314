#!/bin/bash
# The quality suite on the H200 in one device call of at most ~570 s: the flow runner (`eval --flow`:
# each sample's policy requests start as soon as its dense request ends and reuse its prefix-cached
# prompt; at most --max-open samples open), POLICIES on every sample at RETENTIONS, ABLATIONS on the
# first ABLATION_SAMPLES samples per task and context, 2K/4K/8K. Samples open in index order (every
# task and context alike), so a run cut by the time limit is balanced; what still runs at the limit
# is aborted and only complete samples are scored.
#
# On the device machine, from the repository root, after the GPU install (vLLM 0.26.0 in /tmp/site,
# /tmp/sfi-env.sh), with .gpu-data carried (the suite files, made on the development machine:
# sfi-vllm suite --contexts C --samples 120 --out .gpu-data/suite/suite-C.jsonl.xz):
#   OUT=$OUT bash benchmarks/results/quality-h200-sweep.sh [TIME_LIMIT_S [ABLATION_SAMPLES [FIRST_SAMPLE]]]
# POLICIES (default: dense, the default sfi, the paper's Selector and the three baselines; dense
# always runs, it is the prefix every sample's other requests reuse), RETENTIONS (default 0,0.2,
# 0 is the engine's own working set: sinks 4 + K 2048 + window 256), ABLATIONS (default the default
# sfi's ablations), TAG (output name, default quality-h200).
# SFI_ENGINE_KWARGS: JSON passed as `eval --engine-kwargs`, e.g. '{"enforce_eager": false}'.
# MAX_NUM_SEQS (default 256) and MAX_OPEN (default 128): the engine's max_num_seqs and the samples
# open at once. COMPACT_GIB (default 25): sfi.compact_memory_gib, through $SFI_CONFIG. The pool must
# hold a set for each of MAX_NUM_SEQS requests (SmolLM2's sets are 90 MiB: 25 GiB hold 283), or the
# eval refuses to run (requests beyond the pool would run densely and be scored as SFI); the
# default pool, 10% of the GPU, holds 89 on an H100.
# TIME_LIMIT_S (default 440) is generation time after the engine has started; the whole call takes
# about TIME_LIMIT_S + 90 s (imports, suite, engine start, scoring; + ~45 s if /tmp/sfi-smol must
# first be converted from the GGUF). FIRST_SAMPLE > 0 extends an earlier run with the samples from
# that index on; merge with `sfi-vllm rescore RAW1,RAW2 --out rows.jsonl --merged-raw raw.jsonl`.
# Writes to $OUT: $TAG[-fromF].jsonl (rows), -raw.jsonl.xz (every request), .md (tables),
# eval.log; stream.jsonl.xz if the eval failed. The plot: `sfi-vllm report` on the development machine.
set -uo pipefail
. /tmp/sfi-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/q-out}; mkdir -p "$OUT"
LIMIT=${1:-440}; ABL=${2:-30}; FIRST=${3:-0}
TAG=${TAG:-quality-h200}; [ "$FIRST" = 0 ] || TAG=$TAG-from$FIRST
[ -z "${POLICIES:-}" ] || echo "policies: $POLICIES"
M=/tmp/sfi-smol
t_start=$(date +%s)
python3 -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, '| gpu', torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git log -1 --format='sfi-vllm commit %h %s' 2>/dev/null
if [ ! -f $M/config.json ]; then  # convert the GGUF in its own process (a conversion and an engine in one process can stall)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from gpu_smoke import convert; convert('/tmp/sfi-model/SmolLM2-135M-Instruct.Q4_1.gguf', Path('$M'))" \
    > "$OUT/convert.log" 2>&1 || { echo "convert failed"; tail -30 "$OUT/convert.log"; exit 1; }
  echo "converted in $(( $(date +%s) - t_start )) s"
fi
S=.gpu-data/suite
printf 'compact_memory_gib: %s\n' "${COMPACT_GIB:-25}" > /tmp/sfi-sweep.yaml
export SFI_CONFIG=/tmp/sfi-sweep.yaml
python3 -m sfi_vllm.tools.cli eval --model $M --suite $S/suite-2048.jsonl.xz,$S/suite-4096.jsonl.xz,$S/suite-8192.jsonl.xz \
  --contexts 2048,4096,8192 --samples "${SAMPLES:-120}" --first-sample "$FIRST" --no-progress \
  --policies "${POLICIES:-dense,sfi@0/0.1/0.2,sfi-paper@0.1/0.2,quest@0.2,snapkv@0.2,streaming@0.2}" --retentions "${RETENTIONS:-0,0.2}" \
  --ablations "${ABLATIONS:-sfi-no-bridge,sfi-no-follow,sfi-bridge-32,sfi-nms}" --ablation-samples "$ABL" \
  --flow --max-num-seqs "${MAX_NUM_SEQS:-256}" --max-open "${MAX_OPEN:-128}" --time-limit "$LIMIT" --gpu-memory-utilization 0.85 \
  --stream /tmp/q-stream.jsonl --out "$OUT/$TAG.jsonl" --raw "/tmp/$TAG-raw.jsonl" ${SFI_ENGINE_KWARGS:+--engine-kwargs "$SFI_ENGINE_KWARGS"} 2>&1 | tee "$OUT/eval.log"
rc=${PIPESTATUS[0]}
echo "eval exit $rc after $(( $(date +%s) - t_start )) s"
if [ "$rc" = 0 ]; then
  python3 - "$OUT/$TAG" "/tmp/$TAG-raw.jsonl" <<'EOF'
import sys
from pathlib import Path
from sfi_vllm.tools.quality.report import load, markdown
prefix, raw = sys.argv[1], sys.argv[2]
md = markdown(load(prefix + ".jsonl"), "Quality suite on the H200", raw=load(raw))
Path(prefix + ".md").write_text(md)
print(md.split("Over all contexts")[0])  # suite means and paired differences
EOF
  xz -T0 -c "/tmp/$TAG-raw.jsonl" > "$OUT/$TAG-raw.jsonl.xz"
else
  [ -f /tmp/q-stream.jsonl ] && xz -T0 -c /tmp/q-stream.jsonl > "$OUT/stream.jsonl.xz"
fi
echo "done after $(( $(date +%s) - t_start )) s"
