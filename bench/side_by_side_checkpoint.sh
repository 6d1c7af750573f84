#!/usr/bin/env bash
# ../shared/peers/side_by_side.sh with both servers on one checkpoint folder (for instance
# the W8A8 one bench/w8a8_int8_checkpoint.py writes) instead of vLLM on the bfloat16 folder
# and aioserve on the default GGUF. The shared script is read-only and names its two models
# in two lines; this runs a copy of it with those lines pointing at the folder, and stops
# if the shared script no longer has them.
#
#   bash bench/side_by_side_checkpoint.sh bench/results/<dir> ~/.cache/aioserve-peers/models/SmolLM2-135M-Instruct-W8A8
set -euo pipefail
results=${1:?usage: side_by_side_checkpoint.sh RESULTS_DIR MODEL_FOLDER}
model=$(realpath "${2:?usage: side_by_side_checkpoint.sh RESULTS_DIR MODEL_FOLDER}")
shared=${PEERS_SCRIPT:-$(dirname "$0")/../../shared/peers/side_by_side.sh}
copy=$(mktemp)
trap 'rm -f "$copy"' EXIT
sed -e "s|^MODEL_PATH=.*|MODEL_PATH=$model|" -e "s|^GGUF=.*|GGUF=$model|" "$shared" > "$copy"
if [ "$(grep -c -x -e "MODEL_PATH=$model" -e "GGUF=$model" "$copy")" != 2 ]; then
  echo "$shared no longer sets MODEL_PATH= and GGUF= on lines of their own" >&2
  exit 1
fi
bash "$copy" "$results" auto
