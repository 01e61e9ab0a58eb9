#!/usr/bin/env bash
# GPU check of the weighted strategies: tests/gpu/test_gpu.py on CUDA (`-k cuda`). The worked trace and the float64
# oracle over NCCL (1 rank: DDP and FSDP2) and over gloo on CUDA tensors (2 ranks sharing GPU 0: DDP), counts
# returned by training_step and counts ahead; no device synchronisation inside a microbatch on any path, engine or
# integration (Trainer DDP, FSDP2, FSDP1 and Fabric DDP, FSDP2, under torch.cuda.set_sync_debug_mode("error")), and
# the sync check catching a count the user's own step reads back from the device; paired
# step times ddp_weighted / ddp on a ~100M-parameter transformer in bf16-mixed (printed as RESULT lines). At most
# 8 minutes on one GPU. Without a CUDA device it prints SKIP and exits 0; the same tests' CPU dry run is part of
# `python -m pytest`.
#
# Usage: scripts/gpu_check.sh [pytest arguments]
#   PYTHON            interpreter with lightning_weighted's test dependencies (default: python, else python3)
#   GPU_CHECK_TIMEOUT hard limit for the whole check in seconds (default 480)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-$(command -v python || command -v python3)}"
describe='import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, end="")'
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "SKIP gpu_check: no CUDA device ($("$python" -c "$describe"))"
  exit 0
fi
echo "gpu_check: $("$python" -c "$describe"), $("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')"
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-480}" \
  "$python" -m pytest tests/gpu -q -s -rA -k cuda "$@"
