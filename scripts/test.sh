#!/usr/bin/env bash
# README's test command: install, then the whole CPU test suite (Triton kernels under
# TRITON_INTERPRET=1, multi-rank logic in gloo processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
