#!/usr/bin/env bash
# GPU check of ddp_weighted and fsdp2_weighted on a CUDA machine: the worked trace and the float64 oracle with NCCL
# (1 rank: DDP and FSDP2) and with gloo on CUDA tensors (2 ranks sharing GPU 0: DDP). One PASS/FAIL line per check
# with its time; exit status 1 on any failure. Without a CUDA device it prints SKIP and exits 0.
#
# Usage: scripts/gpu_check.sh [--device cpu]
#   PYTHON            interpreter with lightning_weighted's dependencies (default: python, else python3)
#   GPU_CHECK_TIMEOUT hard limit for the whole check in seconds (default 540)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-$(command -v python || command -v python3)}"
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-540}" "$python" scripts/gpu_check.py "$@"
