#!/usr/bin/env bash
# vLLM-CPU and aioserve measured in alternation, both servers started once and left running,
# so that each ratio compares two runs taken a minute apart rather than minutes apart.
#
# ../shared/peers/side_by_side.sh serves vLLM, benchmarks it, stops it, then does the same
# for aioserve: one run of each, ~2 minutes apart. On this project's shared 2-core hosts one
# server's total tok/s at rate inf moved by ±5% between back-to-back runs (bench/RESULTS.md),
# so one such ratio is one draw of that noise. Here both servers stay up (each idle while
# the other runs) and the same workload (`vllm bench serve`, random 256 in / 128 out, the
# shared script's options) runs PAIRS times against each, in the order vLLM, aioserve, then
# aioserve, vLLM, and so on, every pair with prompts of its own (seed) so that no run meets
# the prefix cache. The idle server is stopped (SIGSTOP to its process group) while the other
# runs, so that nothing it does in the background (the CPU each uses over 10 s idle is
# printed first) takes from the other. It prints every pair's ratio and their median, at
# rate inf (64 prompts) and at concurrency 1 (16 prompts).
#
#   bash bench/side_by_side_paired.sh bench/results/<dir> [PAIRS]   # default 4 pairs
#
# vLLM serves the bfloat16 folder of ../shared/peers (VLLM_DTYPE, default bfloat16);
# aioserve the default GGUF with --dtype auto (AIOSERVE_ARGS adds options).
set -uo pipefail
results=${1:?usage: side_by_side_paired.sh RESULTS_DIR [PAIRS]}
pairs=${2:-4}
peers_home=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
vllm=$peers_home/vllm-venv/bin/vllm
model_path=$peers_home/models/SmolLM2-135M-Instruct
gguf=$(python -c "from aioserve.models.resolve import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$results"
{ echo "# $(date -Is) $(lscpu | grep 'Model name' | sed 's/  */ /g') nproc=$(nproc)"
  echo "# flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_int8|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log -1 --oneline 2>/dev/null; } > "$results/host.txt"
cat "$results/host.txt"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -CONT -- "-$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  sleep 5
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}
trap cleanup EXIT

wait_ready() {  # port pid
  for _ in $(seq 1 300); do
    sleep 2
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
  done
  return 1
}

start=$SECONDS
VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$vllm" serve "$model_path" --host 127.0.0.1 --port 8100 \
  --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 2048 --served-model-name smol \
  > "$results/server-vllm.log" 2>&1 &
pids+=($!)
wait_ready 8100 "${pids[0]}" || { echo "vLLM did not start: $results/server-vllm.log"; exit 1; }
echo "vllm ready in $((SECONDS - start)) s"
start=$SECONDS
# shellcheck disable=SC2086
setsid python -m aioserve serve "$gguf" --host 127.0.0.1 --port 8200 --dtype auto \
  --max-model-len 2048 --served-model-name smol --disable-log-stats ${AIOSERVE_ARGS:-} \
  > "$results/server-aioserve.log" 2>&1 &
pids+=($!)
wait_ready 8200 "${pids[1]}" || { echo "aioserve did not start: $results/server-aioserve.log"; exit 1; }
echo "aioserve ready in $((SECONDS - start)) s"

cpu_ticks() {  # CPU time, in clock ticks, of every process in the session $1
  local total=0 pid
  for pid in $(ps -o pid= -s "$1"); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

idle_before=($(cpu_ticks "${pids[0]}") $(cpu_ticks "${pids[1]}"))
sleep 10
echo "idle for 10 s, CPU used: vllm $(($(cpu_ticks "${pids[0]}") - idle_before[0])) ticks," \
  "aioserve $(($(cpu_ticks "${pids[1]}") - idle_before[1])) ticks (of $(getconf CLK_TCK) a second)" \
  | tee "$results/idle.txt"

bench() {  # name port concurrency prompts seed
  local cargs=()
  [ "$3" != inf ] && cargs=(--max-concurrency "$3")
  "$vllm" bench serve --backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions \
    --model smol --tokenizer "$model_path" --dataset-name random --random-input-len 256 \
    --random-output-len 128 --num-prompts "$4" --request-rate inf "${cargs[@]}" --seed "$5" \
    --temperature 0 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$results" --result-filename "$1.json" > "$results/$1.log" 2>&1
}

run_pairs() {  # concurrency prompts first_seed
  for i in $(seq 1 "$pairs"); do
    local seed=$(($3 + i)) order=(vllm aioserve)
    [ $((i % 2)) = 0 ] && order=(aioserve vllm)
    for server in "${order[@]}"; do
      local port=8100 idle=${pids[1]}
      [ "$server" = aioserve ] && port=8200 idle=${pids[0]}
      kill -STOP -- "-$idle"
      bench "$server-c$1-pair$i" "$port" "$1" "$2" "$seed"
      kill -CONT -- "-$idle"
    done
  done
}

run_pairs inf 64 0
run_pairs 1 16 100

python - "$results" "$pairs" <<'EOF'
import json, statistics, sys
from pathlib import Path

results, pairs = Path(sys.argv[1]), int(sys.argv[2])

def figure(server: str, concurrency: str, pair: int, key: str) -> float:
    return json.loads((results / f"{server}-c{concurrency}-pair{pair}.json").read_text())[key]

lines = []
for concurrency, key, label in (
    ("inf", "total_token_throughput", "rate inf, 64 prompts: total tok/s"),
    ("1", "mean_tpot_ms", "concurrency 1, 16 prompts: mean TPOT ms"),
):
    lines += [f"| pair | {label}: vLLM | aioserve | aioserve / vLLM |", "|---|---|---|---|"]
    ratios = []
    for pair in range(1, pairs + 1):
        ours = figure("aioserve", concurrency, pair, key)
        theirs = figure("vllm", concurrency, pair, key)
        ratios.append(ours / theirs)
        lines.append(f"| {pair} | {theirs:,.1f} | {ours:,.1f} | {ours / theirs:.3f} |")
    lines.append(f"| median | | | **{statistics.median(ratios):.3f}** |")
    lines.append("")
text = "\n".join(lines)
(results / "paired.md").write_text(text)
print(text)
EOF
