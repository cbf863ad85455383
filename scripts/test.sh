#!/usr/bin/env bash
# README's test command: install, then the whole CPU test suite (Triton kernels under
# TRITON_INTERPRET=1, multi-rank logic in gloo processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest workers (pytest-xdist, a dev dependency), a whole file per worker: most tests are one
# single-threaded process, so two cores run the suite in about two thirds of the serial time.
workers=()
"${PYTHON:-python3}" -c "import xdist" 2>/dev/null && workers=(-n 2 --dist loadfile)
# The slowest tests are listed at the end (CI's time budget is 15 minutes on 2 cores).
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 "${workers[@]}" "$@"
