#!/usr/bin/env bash
# One GPU check in one command: the GPU suite (tests/gpu, in parallel on the one GPU), then the GPU bench alone on
# it (GPT 1.3B, bf16, rapidtrain vs a plain loop vs HF Trainer, with and without torch.compile). Logs and the bench's
# rows go to $OUT (default ./gpu-check-out); the summary is printed last.
#
#     bash scripts/gpu_check.sh [pytest -k expression]
#
# For a machine with no package registry: a folder .gpu/ beside this repo's files may hold wheels (.gpu/whl) and
# unpacked packages (.gpu/site, e.g. DeepSpeed installed without its ops); they are installed into /tmp/site first.
# Budgets: TESTS_S (default 240) and BENCH_S (default 300, per bench run) seconds; BENCH_ARGS below.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "scripts/gpu_check.sh checks a CUDA GPU and none is visible here: nothing was run"
    exit 0
fi
mkdir -p "$OUT"
if [ -d .gpu ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu/whl/*.whl || exit 1
    fi
    [ -d .gpu/site ] && cp -r .gpu/site/. /tmp/site/
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt" || exit 1
import torch, deepspeed, transformers, rapidtrain
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "cc",
      torch.cuda.get_device_capability(), "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)
EOF
start=$(date +%s)
K=${1:-}
timeout "${TESTS_S:-240}" python3 -m pytest tests/gpu -p no:cacheprovider -n 8 --dist load --timeout 200 -rfE -q \
    ${K:+-k "$K"} --junitxml "$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests/gpu: exit $? after $(( $(date +%s) - start )) s"
timeout 60 python3 bench/head_loss.py > "$OUT/head_loss.log" 2>&1
echo "head_loss: exit $?"
# BENCH_ARGS: the bench's arguments (several runs: separated by ';'); BENCH_S: the seconds each run may take.
IFS=';' read -ra runs <<< "${BENCH_ARGS:---sizes 1.3b --iters 20 --warmup 6 --no-memory}"
for args in "${runs[@]}"; do
    start=$(date +%s)
    eval "set -- $args"
    timeout "${BENCH_S:-300}" python3 bench/gpu_throughput.py "$@" >> "$OUT/bench.log" 2>&1
    echo "bench $args: exit $? after $(( $(date +%s) - start )) s"
done
echo "===== tests/gpu (tail) ====="
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-400 | tail -40
echo "===== head + loss ====="
tail -8 "$OUT/head_loss.log" | cut -c1-300
echo "===== bench ====="
grep -vE "^\s*$" "$OUT/bench.log" | tail -40 | cut -c1-400
