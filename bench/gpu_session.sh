#!/usr/bin/env bash
# The whole GPU session of issue 2 in one command, run from the repository root on a lent
# GPU machine (no network there): compiled kernel and model-parity tests, every kernel's
# achieved bandwidth, and an end-to-end offline throughput run.
#
# THE CALLS (the device tool's `run`, from a session whose checkout holds .whl/, see below);
# a call may last 600 s, and a lease now has 15 minutes of device time in all, starts
# included, so the first call runs what no earlier lease has recorded for the current code
# (the GPU tests and the batch-1 decode of issue 14's 5.6 ms goal; the full kernel table was
# recorded on 2026-11-27), and a second one, if the lease has time left, the rest:
#
#   run(command="bash bench/gpu_session.sh tests decode", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/gpu_session.sh kernels throughput", carry=[".whl"], timeout_s=600)
#
# It ends, within the 12,000 characters the tool returns, with a summary: the kernel report
# (bandwidth table), the test counts and failed test names, the throughput line, the device
# and each stage's exit code and time. The full outputs come back as files (8, the most the
# tool returns):
#   environment.txt      GPU, driver, package versions
#   pytest_gpu.log/.xml  the compiled tests (junit xml)
#   kernel_bandwidth.md  the kernel report: device, copy ceiling, byte formulas, table
#   kernel_bandwidth.log its progress, one line per case (and tracebacks)
#   kernel_bandwidth.json every row
#   throughput.log/.json `aioserve bench throughput`
#   decode_roofline.log  batch-1 decode ms/token and GB/s at Llama-3-8B's shape (decode stage)
# Then record what passed and the bandwidth table in bench/RESULTS.md ("GPU" section),
# with the device named.
#
# Stages, in order; each one's exit code is recorded and a failed one does not stop the
# next. Name some to run only those (e.g. a second call after a stage ran out of time):
#   tests       pytest -m gpu over tests/kernels, tests/models and tests/runner (bf16, fp16
#               and fp32 cases; decode steps replayed from CUDA graphs)
#   kernels     python3 bench/kernel_bandwidth.py --json ...
#   throughput  python3 -m aioserve bench throughput, SmolLM2-135M's shapes with random
#               weights (--load-format dummy) in bf16: the GGUF (96 MB) is over the 64 MiB a
#               call carries, so bench/gpu_model/ holds its config and tokenizer (1.6 MB)
#   graphs      python3 bench/kernel_bandwidth.py --cuda-graphs over GRAPHS_ONLY (default: the
#               quantized linear layers at Llama-3-8B's shapes, one row, bf16): the device's
#               time of a call without the host's launch, which bounds do_bench's times at
#               one row (kernel_graphs.md/.json/.log); not run unless named
#   decode      python3 bench/decode_roofline.py, with CUDA graphs and with --enforce-eager:
#               one stream's decode ms/token at Llama-3-8B's shapes (bench/gpu_model_llama3_8b: its config only, random
#               weights, bf16), the weights' bytes a token over that time against the
#               device's HBM peak and a measured copy; not run unless named
#   bash bench/gpu_session.sh kernels throughput
# Time limits per stage (seconds; together 560, under the tool's 600 a call):
# TESTS_TIMEOUT_S (180), KERNELS_TIMEOUT_S (230), THROUGHPUT_TIMEOUT_S (150);
# DECODE_TIMEOUT_S (400, half to each run; 580 s with the tests); GRAPHS_TIMEOUT_S
# (120). The tool returns 8 files: name graphs or decode in a call of their own, or with one
# other stage. A stage cut short still leaves its log, and kernel_bandwidth.py reports the
# cases it finished.
# KERNELS_ONLY, when set, is kernel_bandwidth.py's --only REGEX: the cases to run when a
# lease is too short for all of them (884 at bf16 and fp16 since the quantized kernels,
# 16 more since the MoE layers: '^fused_moe' runs those alone).
# THROUGHPUT_PROMPTS (1000) sizes the throughput workload (256 prompt tokens and 128 output
# tokens each, at most 256 sequences a step).
#
# PREPARATION, once per checkout, on a machine with PyPI (done in the checkout where this
# script was written; .whl/ is about 250 kB). The GPU image lacks two packages aioserve
# imports, gguf and orjson (their own needs, numpy, pyyaml, requests and tqdm, are
# there). They travel as wheels in .whl/, which git must ignore (it then travels only when
# carried); .gitignore does not list it, so .git/info/exclude does:
#
#   grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl gguf==0.19.0 orjson==3.13.0
#
# Without a GPU the stages still run, for a dry run of this script: the tests are all
# skipped, kernel_bandwidth.py refuses (exit 2) and the throughput run is on the CPU
# (keep it small: THROUGHPUT_PROMPTS=1 bash bench/gpu_session.sh).

set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
OUT=${OUT:-/tmp/gpu_session}  # the device tool sets OUT; elsewhere the files land here
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-180}
KERNELS_TIMEOUT_S=${KERNELS_TIMEOUT_S:-230}
THROUGHPUT_TIMEOUT_S=${THROUGHPUT_TIMEOUT_S:-150}
THROUGHPUT_PROMPTS=${THROUGHPUT_PROMPTS:-1000}
DECODE_TIMEOUT_S=${DECODE_TIMEOUT_S:-400}
DECODE_MODEL=${DECODE_MODEL:-bench/gpu_model_llama3_8b}
GRAPHS_TIMEOUT_S=${GRAPHS_TIMEOUT_S:-120}
GRAPHS_ONLY=${GRAPHS_ONLY:-'^(gguf_linear|fp8_linear|int4_group_linear).*\| llama3-8b \|.*decode 1 \| bf16$'}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests kernels throughput)
for stage in "${STAGES[@]}"; do
    case $stage in
        tests | kernels | throughput | graphs | decode) ;;
        *) echo "unknown stage '$stage': choose among tests, kernels, throughput, graphs, decode" >&2
           exit 2 ;;
    esac
done

# The carried wheels go to their own folder, ahead of the image's packages; the repository
# goes first, so `import aioserve` needs no pip install.
SITE=/tmp/site
PYTHONPATH=$REPO
if compgen -G ".whl/*.whl" > /dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl; then
        PYTHONPATH=$REPO:$SITE
    else
        echo "WARNING: installing the carried wheels failed; gguf and orjson may be missing"
    fi
else
    echo "WARNING: no .whl/*.whl here (carry=[\".whl\"]?): gguf and orjson may be missing"
fi
export PYTHONPATH

{
    echo "== environment, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
            --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    python3 - << 'EOF'
import importlib.metadata
import platform

import torch

import aioserve

if torch.cuda.is_available():
    print("torch.cuda.get_device_name():", torch.cuda.get_device_name())
else:
    print("torch sees no GPU")
print("python", platform.python_version(), "| aioserve from", aioserve.__file__)
names = ["torch", "triton", "transformers", "tokenizers", "numpy", "aiohttp", "uvloop",
         "orjson", "gguf", "prometheus-client", "pytest", "pytest-xdist", "hypothesis"]
for name in names:
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = "MISSING"
    print(f"{name} {version}")
EOF
} 2>&1 | tee "$OUT/environment.txt"

declare -A RESULT
# run_stage NAME FUNCTION: runs the stage (which puts its own time limit on its command)
# and records its exit code and duration.
run_stage() {
    echo
    echo "== $1"
    local start=$SECONDS
    "$2"
    local rc=$?
    local note=""
    case $rc in 124 | 137) note=" (time limit reached)" ;; esac
    RESULT[$1]="exit $rc after $((SECONDS - start))s$note"
}

limited() {  # limited SECONDS COMMAND...: the command, ended when it runs past SECONDS
    timeout --kill-after=10 "$@"
}

tests_stage() {
    # Several workers compile their Triton kernels side by side.
    local workers=()
    python3 -c "import xdist" 2> /dev/null && workers=(-n 8)
    limited "$TESTS_TIMEOUT_S" python3 -m pytest -m gpu -q -p no:cacheprovider "${workers[@]}" \
        --junitxml="$OUT/pytest_gpu.xml" tests/kernels tests/models tests/runner 2>&1 |
        tee "$OUT/pytest_gpu.log"
}

kernels_stage() {
    # The report (stdout) is a file of its own; progress goes to the log and the console.
    local only=()
    [ -n "${KERNELS_ONLY:-}" ] && only=(--only "$KERNELS_ONLY")
    limited "$KERNELS_TIMEOUT_S" python3 bench/kernel_bandwidth.py "${only[@]}" \
        --json "$OUT/kernel_bandwidth.json" > "$OUT/kernel_bandwidth.md" \
        2> >(tee "$OUT/kernel_bandwidth.log" >&2)
}

throughput_stage() {
    limited "$THROUGHPUT_TIMEOUT_S" python3 -m aioserve bench throughput \
        --model bench/gpu_model --load-format dummy --dtype bfloat16 \
        --input-len 256 --output-len 128 --num-prompts "$THROUGHPUT_PROMPTS" \
        --max-num-seqs 256 --output-json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log"
}

graphs_stage() {
    limited "$GRAPHS_TIMEOUT_S" python3 bench/kernel_bandwidth.py --cuda-graphs \
        --only "$GRAPHS_ONLY" --json "$OUT/kernel_graphs.json" > "$OUT/kernel_graphs.md" \
        2> >(tee "$OUT/kernel_graphs.log" >&2)
}

decode_stage() {
    # Decode steps replayed from CUDA graphs (the default), then run eagerly, for the ratio.
    local budget=$((DECODE_TIMEOUT_S / 2)) eager
    : > "$OUT/decode_roofline.log"
    for eager in "" --enforce-eager; do
        echo "-- decode_roofline.py ${eager:-(CUDA graphs)}" | tee -a "$OUT/decode_roofline.log"
        limited "$budget" python3 bench/decode_roofline.py --model "$DECODE_MODEL" \
            --dtype bfloat16 $eager 2>&1 | tee -a "$OUT/decode_roofline.log"
    done
}

for stage in "${STAGES[@]}"; do
    run_stage "$stage" "${stage}_stage"
done

# The summary, most important last (the tool returns the output's last 12,000 characters):
# the kernel report, then the tests, the throughput and each stage's exit code.
echo
echo "== summary"
if [ -s "$OUT/kernel_bandwidth.md" ]; then
    cat "$OUT/kernel_bandwidth.md"
elif [ -f "$OUT/kernel_bandwidth.log" ]; then
    echo "no kernel report; the end of its log:"
    tail -n 5 "$OUT/kernel_bandwidth.log"
fi
if [ -s "$OUT/kernel_graphs.md" ]; then
    echo
    sed -n '/^| kernel/,$p' "$OUT/kernel_graphs.md"
fi
echo
if [ -f "$OUT/pytest_gpu.xml" ]; then
    python3 - "$OUT/pytest_gpu.xml" << 'EOF'
import sys
import xml.etree.ElementTree as ElementTree

MAX_LISTED = 25
outcomes = {"passed": [], "failed": [], "error": [], "skipped": []}
for case in ElementTree.parse(sys.argv[1]).getroot().iter("testcase"):
    tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
        tags[0] if tags else "", "passed"
    )
    outcomes[outcome].append(f"{case.get('classname')}::{case.get('name')}")
print("tests:", ", ".join(f"{len(names)} {kind}" for kind, names in outcomes.items()))
not_passed = outcomes["failed"] + outcomes["error"]
for name in not_passed[:MAX_LISTED]:
    print("  not passed:", name)
if len(not_passed) > MAX_LISTED:
    print(f"  ... and {len(not_passed) - MAX_LISTED} more (pytest_gpu.log)")
EOF
elif [ -f "$OUT/pytest_gpu.log" ]; then
    echo "tests: no junit xml; the end of the log:"
    tail -n 3 "$OUT/pytest_gpu.log"
fi
if [ -f "$OUT/throughput.log" ]; then
    grep -E "^(Throughput|Total num)" "$OUT/throughput.log" || tail -n 3 "$OUT/throughput.log"
fi
if [ -f "$OUT/decode_roofline.log" ]; then
    grep -E "^(-- decode_roofline|device|decode at batch 1|achieved|peak):?" \
        "$OUT/decode_roofline.log" ||
        tail -n 3 "$OUT/decode_roofline.log"
fi
grep -m1 -E "^(torch.cuda.get_device_name|torch sees no GPU)" "$OUT/environment.txt"
for stage in "${STAGES[@]}"; do
    echo "stage $stage: ${RESULT[$stage]}"
done
