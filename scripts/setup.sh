#!/usr/bin/env bash
# Installs interlace (editable) and what it needs into the current python3, if missing.
# torch: an existing torch >= 2.11 is kept (GPU machines); otherwise torch 2.13.0 is installed
# (on our CPU machines pip takes its CPU build from local disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -c 'import triton' 2>/dev/null || "$PY" -m pip install -q triton==3.6.0
"$PY" -m pip install -q -e ".[dev]"
