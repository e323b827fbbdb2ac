#!/usr/bin/env bash
# The device benchmark (benchmarks/gpu.py) from the repository root, offline: bash benchmarks/gpu.sh [--cpu ...]
# PYTHON names the interpreter (default: python3, which on CUDA images is the one that holds torch).
cd "$(dirname "$0")/.." && HF_HUB_OFFLINE=1 exec "${PYTHON:-python3}" benchmarks/gpu.py "$@"
