#!/usr/bin/env bash
# Set up rapidtrain in ./.venv: torch 2.13.0 first (pinned, so pip never resolves a CUDA build by itself),
# then the package with its DeepSpeed, Hugging Face, experiment-tracking and dev extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# DeepSpeed builds from source against the installed torch: no build isolation, or pip would fetch another torch.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[deepspeed,hf,tracking,dev]"
# FairScale (optional --sharding-backend fairscale): its last release works with this torch for OSS/ShardedDDP;
# --no-deps keeps it from touching torch.
.venv/bin/python -m pip install -q --no-build-isolation --no-deps "fairscale==0.4.13"
.venv/bin/python -c "import torch, rapidtrain; print('rapidtrain', rapidtrain.__version__, 'on torch', torch.__version__)"
