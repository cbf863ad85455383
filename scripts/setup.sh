#!/usr/bin/env bash
# Installs interlace (editable) and what it needs into the current python3, if missing.
# torch: an existing torch >= 2.11 is kept (GPU machines); otherwise torch 2.13.0 is installed
# (on our CPU machines pip takes its CPU build from local disk).
# triton: the lowest pyproject.toml's range allows (the CPU build of torch pins none), so the main
# suite runs the lowest and scripts/ci_versions.sh the highest; in CI (CI=true) a Triton of another
# version is replaced by it too, elsewhere an existing one is kept (a GPU torch pins its own).
# numpy: the dev extra keeps it on the lowest minor of the core range (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOWEST_TRITON=3.6.0  # = the lower bound of triton in pyproject.toml
if ! "$PY" -c 'import torch, sys; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
have=$("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || true)
if [ -z "$have" ] || { [ "${CI:-}" = true ] && [ "$have" != "$LOWEST_TRITON" ]; }; then
  "$PY" -m pip install -q "triton==$LOWEST_TRITON"
fi
"$PY" -m pip install -q -e ".[dev]"
"$PY" -c 'import numpy, torch, triton; print(f"installed: torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")'
