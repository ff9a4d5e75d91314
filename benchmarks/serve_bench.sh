#!/bin/bash
# Serving benchmark: `vllm bench serve` (vLLM's own tool) against `vllm serve`, dense and then SFI,
# one after the other on the same GPU, same prompts (random, seed 0), Poisson arrivals.
#
#   qwen   the Qwen3-4B-shaped checkpoint of e2e_bench.py (random weights, a word-level tokenizer
#          over its vocabulary), prompts of 16K-32K tokens, 512 generated tokens each:
#          output tok/s, TTFT, TPOT, ITL and end-to-end latency (p50 / p90 / p99)
#   smol   SmolLM2-135M-Instruct (/tmp/sfi-smol), many short requests (2K-7K prompts, 48 tokens
#          each) sent at once: how long the last requests take while the batch drains
#
# On the device machine, from the repository root, after the GPU install (/tmp/sfi-env.sh):
#   . /tmp/sfi-env.sh && . benchmarks/device_env.sh && OUT=$OUT bash benchmarks/serve_bench.sh qwen
# Settings through the environment: SFI_ARGS (the SFI server's --additional-config JSON, default
# the engine's default selection), WARMUP (prompts sent once, untimed, before the timed passes:
# they meet the first compilations and graph captures; default 0), PROMPTS, RATE, IN_LEN, OUT_LEN, RANGE, PASSES (benchmark runs per server: the
# second pass of the same load meets the kernels compiled and the graphs captured by the first;
# default 1 for qwen, 2 for smol), MODES (default "dense sfi"; "sfi" reruns only the SFI server). Writes to $OUT: serve-bench-<set>-<mode>.json
# (vllm bench serve's result, per-request details included), server logs, the sfi_ lines of
# /metrics after the SFI run.
set -uo pipefail
SET=${1:-qwen}
OUT=${OUT:-/tmp/serve-bench}; mkdir -p "$OUT"
PORT=8013
URL=http://127.0.0.1:$PORT
if [ "$SET" = qwen ]; then
  python3 benchmarks/e2e_bench.py --out "$OUT" --make-model || exit 1
  M=/tmp/sfi-qwen3-4b-shape
  IN_LEN=${IN_LEN:-24576}; RANGE=${RANGE:-0.333}; OUT_LEN=${OUT_LEN:-512}
  PROMPTS=${PROMPTS:-64}; RATE=${RATE:-1.5}; PASSES=${PASSES:-1}
  SERVE_ARGS=(--max-model-len 33792)
  SFI_ARGS=${SFI_ARGS:-'{"sfi": {}}'}
else
  M=/tmp/sfi-smol
  IN_LEN=${IN_LEN:-4608}; RANGE=${RANGE:-0.5}; OUT_LEN=${OUT_LEN:-48}
  PROMPTS=${PROMPTS:-525}; RATE=${RATE:-inf}; PASSES=${PASSES:-2}
  SERVE_ARGS=()
  SFI_ARGS=${SFI_ARGS:-'{"sfi": {}}'}
fi

wait_health() {
  for _ in $(seq 600); do
    curl -sf "$URL/health" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

for MODE in ${MODES:-dense sfi}; do
  LOG="$OUT/serve-bench-$SET-$MODE.log"
  # every Triton compilation after the warm-up at start-up is logged (vLLM's JIT monitor, verbose):
  # a compilation in the timed pass is a pause
  EXTRA=(--jit-monitor-verbose)
  if [ "$MODE" = sfi ]; then
    export PROMETHEUS_MULTIPROC_DIR=$(mktemp -d)
    EXTRA+=(--attention-backend sfi --additional-config "$SFI_ARGS")
  fi
  t0=$(date +%s)
  python3 -m vllm.entrypoints.openai.api_server --model $M --port $PORT --seed 0 "${SERVE_ARGS[@]}" \
    "${EXTRA[@]}" > "$LOG" 2>&1 &
  SERVER=$!
  if ! wait_health; then echo "$MODE: the server did not come up"; tail -30 "$LOG"; kill $SERVER; exit 1; fi
  echo "$MODE: healthy after $(( $(date +%s) - t0 )) s"
  for PASS in $( [ "${WARMUP:-0}" -gt 0 ] && echo warmup; seq "$PASSES"); do
  # the warm-up's prompts are drawn with another seed, so the timed pass meets none of them cached
  N=$([ "$PASS" = warmup ] && echo "$WARMUP" || echo "$PROMPTS"); S=$([ "$PASS" = warmup ] && echo 1 || echo 0)
  NAME=serve-bench-$SET-$MODE$([ "$PASS" = 1 ] || echo "-pass$PASS")
  python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "$URL" --model $M \
    --dataset-name random --random-input-len "$IN_LEN" --random-range-ratio "$RANGE" \
    --random-output-len "$OUT_LEN" --ignore-eos --num-prompts "$N" --request-rate "$RATE" \
    --seed "$S" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --save-detailed --result-dir "$OUT" --result-filename "$NAME.json" \
    --metadata "mode=$MODE" "pass=$PASS" "sfi=$([ "$MODE" = sfi ] && echo "$SFI_ARGS" || echo none)" 2>&1 \
    | grep -E "^(=|-|[A-Z][a-zA-Z ()/]+:)" | tee "$OUT/$NAME.txt"
  done
  if [ "$MODE" = sfi ]; then
    curl -s "$URL/metrics" | grep '^sfi_' > "$OUT/serve-bench-$SET-metrics.txt"
    echo "sfi_ metric lines: $(wc -l < "$OUT/serve-bench-$SET-metrics.txt")"
  fi
  kill $SERVER; wait $SERVER 2>/dev/null
  grep -E "throughput|sfi-vllm" "$LOG" | grep -v -i warning | tail -12
  echo "$MODE: $(grep -c 'kernel JIT compilation during inference' "$LOG") Triton compilations after start-up" \
    "(full log: $LOG)"
  if [ "$MODE" = sfi ]; then  # the log has the first 20 captures and then every 100th; the metric has all
    grep '^sfi_cuda_graph_runs_total' "$OUT/serve-bench-$SET-metrics.txt"
    # requests that ran densely instead of SFI (a full compact-set pool, a bad config): not SFI's speed
    grep '^sfi_request_fallbacks_total' "$OUT/serve-bench-$SET-metrics.txt"
  fi
  if [ "$MODE" = sfi ]; then rm -rf "$PROMETHEUS_MULTIPROC_DIR"; unset PROMETHEUS_MULTIPROC_DIR; fi
done
python3 - "$OUT" "$SET" <<'EOF'
import json, sys
from pathlib import Path
out, name = Path(sys.argv[1]), sys.argv[2]
rows = {}
for p in sorted(out.glob(f"serve-bench-{name}-*.json")):
    rows[p.stem[len(f"serve-bench-{name}-"):]] = json.loads(p.read_text())
keys = ["duration", "completed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms"]
print("| metric | " + " | ".join(rows) + " |")
print("|---|" + "---|" * len(rows))
for k in keys:
    print(f"| {k} | " + " | ".join(str(round(r.get(k, float('nan')), 2)) for r in rows.values()) + " |")
for mode, r in rows.items():
    if "start_times" not in r:
        continue
    start = min(r["start_times"])
    fin = sorted(s - start + t + sum(i) for s, t, i in zip(r["start_times"], r["ttfts"], r["itls"]) if t)
    n = len(fin)
    if n:
        tail = fin[-1] - fin[int(0.95 * (n - 1))]
        print(f"{mode}: {n} requests finished; the last at {fin[-1]:.1f} s; the last 5% took {tail:.1f} s; "
              f"max ITL {max((max(i) for i in r['itls'] if i), default=0) * 1e3:.0f} ms")
    r.pop("generated_texts", None)  # keep the committed file small
    (out / f"serve-bench-{name}-{mode}.json").write_text(json.dumps(r))
EOF
