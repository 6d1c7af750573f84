#!/usr/bin/env bash
# llama.cpp served on the default model's GGUF, driven at concurrency 1 by the client and the
# workload of ../shared/peers/side_by_side.sh (`vllm bench serve`, random 256 in / 128 out,
# 16 prompts, greedy): its mean TPOT is issue 15's one-stream anchor, measured as aioserve's
# and vLLM's are. Run it right after side_by_side.sh, from the project checkout:
#   bash bench/llama_cpp_served.sh RESULTS_DIR [ROUNDS]
# ROUNDS > 1 alternates llama.cpp with aioserve (served alone, as side_by_side.sh serves it),
# round by round, for a ratio the host's drift between runs does not decide.
# Needs llama-cpp-python in $PEERS_HOME/llama-venv (bench/llama_cpp_tpot.py says how) with its
# server's packages (pip install uvicorn fastapi sse-starlette starlette-context pydantic-settings),
# and vLLM's venv and the bf16 model folder of ../shared/peers (the client and its tokenizer).
# llama.cpp's server takes no ignore_eos: a request may end early at the end-of-sequence token,
# which leaves its time per output token a fair figure (the log shows the output lengths).
set -uo pipefail
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/aioserve-peers}
RESULTS=${1:?RESULTS_DIR}; ROUNDS=${2:-1}
VLLM=$PEERS_HOME/vllm-venv/bin/vllm
MODEL_PATH=$PEERS_HOME/models/SmolLM2-135M-Instruct
GGUF=$(python -c "from aioserve.models.resolve import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)")
mkdir -p "$RESULTS"

wait_ready() { for _ in $(seq 1 200); do sleep 2; curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; done; return 1; }
stop() { kill -TERM "$1" 2>/dev/null; for _ in $(seq 1 40); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -KILL -- "-$1" 2>/dev/null; }
one_stream() {  # name port
  "$VLLM" bench serve --backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model smol \
    --tokenizer "$MODEL_PATH" --dataset-name random --random-input-len 256 --random-output-len 128 \
    --num-prompts 16 --request-rate inf --max-concurrency 1 --seed 1 --temperature 0 --ignore-eos \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result \
    --result-dir "$RESULTS" --result-filename "$1.json" > "$RESULTS/$1.log" 2>&1
  grep -E "^(Successful|Total generated tokens|Mean TPOT)" "$RESULTS/$1.log" | sed "s/^/$1: /"
}

setsid "$PEERS_HOME/llama-venv/bin/python" bench/llama_cpp_server.py --model "$GGUF" --n_threads 2 \
  --n_ctx 2048 --model_alias smol --host 127.0.0.1 --port 8300 > "$RESULTS/server-llama-cpp.log" 2>&1 &
llama=$!
if [ "$ROUNDS" -gt 1 ]; then
  setsid python -m aioserve serve "$GGUF" --host 127.0.0.1 --port 8200 --max-model-len 2048 \
    --served-model-name smol --disable-log-stats > "$RESULTS/server-aioserve-rounds.log" 2>&1 &
  aioserve=$!
  wait_ready 8200 $aioserve || { echo "aioserve did not start"; stop $aioserve; stop $llama; exit 1; }
fi
wait_ready 8300 $llama || { echo "llama.cpp did not start: $RESULTS/server-llama-cpp.log"; stop $llama; exit 1; }
for round in $(seq 1 "$ROUNDS"); do
  one_stream "llama-cpp-c1-n16-r$round" 8300
  [ "$ROUNDS" -gt 1 ] && one_stream "aioserve-c1-n16-r$round" 8200
done
stop $llama
[ "$ROUNDS" -gt 1 ] && stop $aioserve
exit 0
