#!/usr/bin/env bash
# The device benchmark (benchmarks/gpu.py) from the repository root, offline: bash benchmarks/gpu.sh [--cpu ...]
cd "$(dirname "$0")/.." && HF_HUB_OFFLINE=1 exec python benchmarks/gpu.py "$@"
