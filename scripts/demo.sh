#!/usr/bin/env bash
# README's demo command: install, then run the demo (torchrun benchmark with >= 2 GPUs;
# on a CPU-only machine every strategy on 2 gloo ranks, checked against the reference).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m interlace.tools.demo "$@"
