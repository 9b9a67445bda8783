#!/usr/bin/env bash
# Set up rapidtrain in ./.venv: torch 2.13.0 first (pinned, so pip never resolves a CUDA build by itself),
# then the package with its DeepSpeed, Hugging Face, low-bit (bitsandbytes, torchao), experiment-tracking and dev
# extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# libaio for DeepSpeed's async_io op (--nvme-offload-dir, ZeRO-Infinity): installed from Debian/Ubuntu where this
# runs as root with apt (CI does); elsewhere --nvme-offload-dir is refused with the reason and its test skips.
if [ ! -f /usr/include/libaio.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null 2>&1 || echo "setup: libaio-dev not installed"
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# DeepSpeed builds from source against the installed torch: no build isolation, or pip would fetch another torch.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[deepspeed,hf,tracking,dev,lowbit]"
# FairScale (optional --sharding-backend fairscale): its last release works with this torch for OSS/ShardedDDP;
# --no-deps keeps it from touching torch.
.venv/bin/python -m pip install -q --no-build-isolation --no-deps "fairscale==0.4.13"
# megatron-core (tests only: tests/distributed/test_megatron_core_checkpoints.py has it write the Megatron-Core
# checkpoints rapidtrain reads): beside the environment, not in it (its `megatron` package would meet rapidtrain's
# Megatron facades), and --no-deps so it never touches torch. Without it that test skips.
.venv/bin/python -m pip install -q --no-deps --target .venv/megatron-core "megatron-core==0.16.1" >/dev/null 2>&1 || echo "setup: megatron-core not installed (its checkpoint test will skip)"
# DeepSpeed JIT-compiles its CPU ops (cpu_adam for --cpu-offload, shm_comm for CPU collectives) on first use, which
# would hold the first ZeRO run silent for a minute or two: build them now, once per machine.
echo "setup: building DeepSpeed's CPU ops (cpu_adam, deepspeed_shm_comm) so the first run does not wait on them"
.venv/bin/python -m rapidtrain.parallel.op_build || echo "setup: DeepSpeed's CPU ops were not built now; the first run that needs one builds it (and says so)"
# Byte-code for the checkout, written once: an editable install has none, and where PYTHONDONTWRITEBYTECODE is set
# (this machine's environment sets it) every process would otherwise compile rapidtrain's ~100 modules again (~0.5 s a start;
# a stale file after an edit is only ignored, never used).
.venv/bin/python -m compileall -q -j 0 rapidtrain tests bench examples templates scripts >/dev/null || echo "setup: byte-code not written"
.venv/bin/python -c "import torch, rapidtrain; print('rapidtrain', rapidtrain.__version__, 'on torch', torch.__version__)"
