#!/usr/bin/env bash
# vLLM-CPU and aioserve at rate inf under sampling settings: greedy, temperature 1,
# temperature 0.7 with top-p 0.9, temperature 1 with top-k 50.
#
# `vllm bench serve` (random 256 in / 128 out, 64 prompts, the shared script's workload)
# drives one server at a time, vLLM first, each through the four settings in that order,
# so that each ratio compares runs a few minutes apart; the first run of a fresh server is
# its greedy one. Both serve the default model as ../shared/peers sets it up (vLLM its
# bfloat16 folder, aioserve the GGUF with --dtype auto).
#
#   bash bench/sampling_side_by_side.sh bench/results/<dir>
set -uo pipefail
results=${1:?usage: sampling_side_by_side.sh RESULTS_DIR}
peers_home=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
vllm=$peers_home/vllm-venv/bin/vllm
model_path=$peers_home/models/SmolLM2-135M-Instruct
gguf=$(python -c "from aioserve.models.resolve import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)")
mkdir -p "$results"
{ echo "# $(date -Is) $(lscpu | grep 'Model name' | sed 's/  */ /g') nproc=$(nproc)"
  echo "# flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_int8|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log -1 --oneline 2>/dev/null; } > "$results/host.txt"
cat "$results/host.txt"
settings=("--temperature 0" "--temperature 1.0" "--temperature 0.7 --top-p 0.9" "--temperature 1.0 --top-k 50")
names=(greedy t1 t07-p09 t1-k50)
wait_ready() {  # port pid
  for _ in $(seq 1 300); do
    sleep 2
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
  done
  return 1
}
for server in vllm aioserve; do
  if [ "$server" = vllm ]; then
    port=8100
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$vllm" serve "$model_path" \
      --host 127.0.0.1 --port $port --dtype bfloat16 --max-model-len 2048 \
      --served-model-name smol > "$results/server-vllm.log" 2>&1 &
  else
    port=8200
    setsid python -m aioserve serve "$gguf" --host 127.0.0.1 --port $port --dtype auto \
      --max-model-len 2048 --served-model-name smol --disable-log-stats \
      > "$results/server-aioserve.log" 2>&1 &
  fi
  pid=$!
  if wait_ready $port $pid; then
    for i in "${!settings[@]}"; do
      # shellcheck disable=SC2086
      "$vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
        --endpoint /v1/completions --model smol --tokenizer "$model_path" \
        --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 64 --request-rate inf --ignore-eos --seed 3 ${settings[$i]} \
        --save-result --result-dir "$results" --result-filename "$server-${names[$i]}.json" \
        > "$results/$server-${names[$i]}.log" 2>&1
      echo "$server ${settings[$i]}: $(grep -E 'Total token throughput' "$results/$server-${names[$i]}.log" | awk '{print $NF}') tok/s," \
        "TPOT $(grep -E 'Mean TPOT' "$results/$server-${names[$i]}.log" | awk '{print $NF}') ms"
    done
  else
    echo "$server did not start: $results/server-$server.log"
  fi
  kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
done
