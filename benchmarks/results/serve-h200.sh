#!/bin/bash
# `vllm serve` on the H200 with vLLM's defaults (max_num_seqs 1024, torch.compile and CUDA graphs,
# gpu_memory_utilization as vLLM resolves it), with SFI and then without it, on SmolLM2-135M-Instruct: the start-up
# memory lines (compact pool, KV cache), a few requests over HTTP (the default, per-request settings
# as flat vllm_xargs keys and as one JSON string, malformed settings that must get a 400 while the
# server keeps serving) and the sfi_ metrics on /metrics.
#
# On the device machine, from the repository root, after the GPU install (/tmp/sfi-env.sh) and the
# model conversion (/tmp/sfi-smol, as quality-h200-sweep.sh does):
#   . /tmp/sfi-env.sh && . benchmarks/device_env.sh && OUT=$OUT bash benchmarks/results/serve-h200.sh
# Writes to $OUT: serve-sfi.log, serve-dense.log, requests.txt (each request and the status and body
# of its answer), metrics.txt (the sfi_ lines of /metrics).
set -uo pipefail
OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
M=/tmp/sfi-smol
PORT=8011
URL=http://127.0.0.1:$PORT

wait_health() {  # $1: seconds
  for _ in $(seq "$1"); do
    curl -sf "$URL/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

post() {  # $1: label, $2: path, $3: JSON body
  local code
  code=$(curl -s -o /tmp/body.json -w '%{http_code}' "$URL$2" -H 'Content-Type: application/json' -d "$3")
  printf '== %s\n%s\n-> %s %s\n\n' "$1" "$3" "$code" "$(head -c 600 /tmp/body.json)" >> "$OUT/requests.txt"
  echo "$1: HTTP $code"
}

serve() {  # $1: log name, rest: extra vllm serve arguments
  local log=$1; shift
  t0=$(date +%s)
  python3 -m vllm.entrypoints.openai.api_server --model $M --port $PORT "$@" > "$OUT/$log" 2>&1 &
  SERVER=$!
  if wait_health 400; then echo "$log: healthy after $(( $(date +%s) - t0 )) s"; else
    echo "$log: no /health after 400 s"; tail -40 "$OUT/$log"; kill $SERVER; return 1; fi
}

export PROMETHEUS_MULTIPROC_DIR=$(mktemp -d)
serve serve-sfi.log --attention-backend sfi || exit 1
CHAT='"model": "'$M'", "messages": [{"role": "user", "content": "Name three rivers of Europe."}], "max_tokens": 32, "temperature": 0'
post "chat, engine default" /v1/chat/completions "{$CHAT}"
post "chat, flat keys" /v1/chat/completions "{$CHAT, \"vllm_xargs\": {\"sfi_policy\": \"quest\", \"sfi_selected_fraction\": 0.2}}"
post "completion, JSON string, streamed" /v1/completions "{\"model\": \"$M\", \"prompt\": \"The river Danube\", \"max_tokens\": 16, \"stream\": true, \"vllm_xargs\": {\"sfi\": \"{\\\"bridge_steps\\\": 0}\"}}"
post "bad: sfi as a plain string" /v1/chat/completions "{$CHAT, \"vllm_xargs\": {\"sfi\": \"dense\"}}"
post "bad: unknown key" /v1/chat/completions "{$CHAT, \"vllm_xargs\": {\"sfi_polcy\": \"dense\"}}"
post "bad: out of range" /v1/chat/completions "{$CHAT, \"vllm_xargs\": {\"sfi_recent_window\": 0}}"
post "bad: engine-wide key" /v1/chat/completions "{$CHAT, \"vllm_xargs\": {\"sfi_kernels\": \"torch\"}}"
post "after the bad ones" /v1/chat/completions "{$CHAT}"
curl -s -o /dev/null -w 'health after the bad requests: %{http_code}\n' "$URL/health"
sleep 2
curl -s "$URL/metrics" | grep '^sfi_' > "$OUT/metrics.txt"
echo "sfi_ metric lines: $(wc -l < "$OUT/metrics.txt")"
kill $SERVER; wait $SERVER 2>/dev/null
grep -i -E "sfi-vllm|KV cache|compact" "$OUT/serve-sfi.log" | grep -v -i "warning: " | head -20
rm -rf "$PROMETHEUS_MULTIPROC_DIR"; unset PROMETHEUS_MULTIPROC_DIR
serve serve-dense.log || exit 1
post "dense server, chat" /v1/chat/completions "{$CHAT}"
kill $SERVER; wait $SERVER 2>/dev/null
grep -i -E "KV cache|Maximum concurrency" "$OUT/serve-dense.log" | head -5
