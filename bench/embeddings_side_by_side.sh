#!/usr/bin/env bash
# Embeddings served by vLLM-CPU and by aioserve in turn on this host, both driven by vLLM's
# own client (`vllm bench serve --backend openai-embeddings`, random prompts of INPUT_LEN
# tokens, default 128): NUM_PROMPTS (default 256) at rate inf, then 32 at concurrency 1.
# The model: sentence-transformers/all-MiniLM-L6-v2 from its PyPI package (a BERT).
# Run from the checkout, where aioserve is installed; vLLM from ../shared/peers:
#   bash bench/embeddings_side_by_side.sh [RESULTS_DIR] [ROUNDS]     (default: 2 rounds)
# Each round serves vLLM, then aioserve (each at its dtype "auto"), so that the host's drift
# between the turns shows in the spread. VLLM_DTYPE / AIOSERVE_DTYPE override the dtypes.
set -uo pipefail
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
RESULTS=${1:-bench/results/embeddings-$(date +%Y%m%d-%H%M)}
ROUNDS=${2:-2}
INPUT_LEN=${INPUT_LEN:-128}
NUM_PROMPTS=${NUM_PROMPTS:-256}
VLLM=$PEERS_HOME/vllm-venv/bin/vllm
MODEL=$(python -c "from aioserve.models.resolve import resolve_model; print(resolve_model('sentence-transformers/all-MiniLM-L6-v2').path)")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
mkdir -p "$RESULTS"
{ echo "# $(date -Is) $(lscpu | grep 'Model name' | sed 's/  */ /g') nproc=$(nproc)"
  echo "# flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_int8|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log -1 --oneline 2>/dev/null; } > "$RESULTS/host.txt"
cat "$RESULTS/host.txt"

wait_ready() { for _ in $(seq 1 200); do sleep 2; curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; done; return 1; }
stop() { kill -TERM "$1" 2>/dev/null; for _ in $(seq 1 40); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -KILL -- "-$1" 2>/dev/null; }
bench() {  # tag port
  for spec in "inf $NUM_PROMPTS" "1 32"; do
    set -- "$1" "$2" $spec
    local name="$1-c$3-n$4" cargs=(); [ "$3" != inf ] && cargs=(--max-concurrency "$3")
    "$VLLM" bench serve --backend openai-embeddings --base-url "http://127.0.0.1:$2" \
      --endpoint /v1/embeddings --model minilm --tokenizer "$MODEL" --dataset-name random \
      --random-input-len "$INPUT_LEN" --num-prompts "$4" --request-rate inf "${cargs[@]}" --seed 1 \
      --save-result --result-dir "$RESULTS" --result-filename "$name.json" > "$RESULTS/$name.log" 2>&1
    grep -E "^(Successful|Request throughput|Total token throughput|Mean E2EL)" "$RESULTS/$name.log" \
      | sed "s/^/$name: /"
  done
}

for round in $(seq 1 "$ROUNDS"); do
  t0=$SECONDS
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$VLLM" serve "$MODEL" --host 127.0.0.1 --port 8101 \
    --dtype "${VLLM_DTYPE:-auto}" --served-model-name minilm > "$RESULTS/server-vllm-$round.log" 2>&1 &
  pid=$!
  if wait_ready 8101 $pid; then echo "vllm ready in $((SECONDS - t0)) s"; bench "vllm-r$round" 8101
  else echo "vLLM did not start: $RESULTS/server-vllm-$round.log"; fi
  stop $pid
  t0=$SECONDS
  setsid python -m aioserve serve "$MODEL" --host 127.0.0.1 --port 8201 --dtype "${AIOSERVE_DTYPE:-auto}" \
    --served-model-name minilm --disable-log-stats > "$RESULTS/server-aioserve-$round.log" 2>&1 &
  pid=$!
  if wait_ready 8201 $pid; then echo "aioserve ready in $((SECONDS - t0)) s"; bench "aioserve-r$round" 8201
  else echo "aioserve did not start: $RESULTS/server-aioserve-$round.log"; fi
  stop $pid
done
