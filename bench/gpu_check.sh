#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA GPU and no network (the device machine):
#
#   bash bench/gpu_check.sh [OUT_DIR] [more bench/gpu_check.py options]
#
# Runs from the checkout itself (no install): that machine's python3 already holds torch,
# transformers, safetensors and scipy. Writes gpu-check-<date>-<gpu>.json and .md to OUT_DIR
# (default: $OUT when set, else bench/results); commit them under bench/results/. The checks keep
# to a 420 s budget; `timeout` is the backstop for anything that hangs outside Python.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 python3 bench/gpu_check.py --out "$out" "$@"
