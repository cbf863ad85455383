#!/usr/bin/env bash
# CI's second job (.ci/run, after the main suite): interlace on the HIGHEST versions that
# pyproject.toml's ranges allow, as a fresh `pip install .` gets them. The main job (scripts/test.sh)
# runs the lowest (scripts/setup.sh).
#
# A fresh venv gets torch 2.13.0 (the CPU build we test, from local disk on our machines; the
# newest torch would be a CUDA build of several GB, so torch's range has an upper bound instead),
# then a plain `pip install .` of this tree, which resolves Triton and NumPy to the newest releases
# inside their ranges at this moment: a release inside a range is run here at CI's next run.
# Then `interlace demo` (the installed command: 2 gloo ranks, every CPU strategy, Triton's CPU
# interpreter) and a smoke subset of the tests (the interpreter fixes and the kernels the demo does
# not reach). Exits non-zero if either fails. About 3 minutes on 2 cores, most of it the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/interlace-ci-versions.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The tree as git sees it (tracked and new files, not ignored ones such as an old build/, which
# setuptools would pack into the wheel): what a clean clone installs.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"

python3 -m venv "$work/venv"
PY=$work/venv/bin/python
# --no-compile: byte-compiling torch's files is a large share of its install time.
"$PY" -m pip install -q --no-compile torch==2.13.0
"$PY" -m pip install -q --no-compile "$work/src" pytest pytest-timeout pytest-xdist
"$PY" -m pip check
versions=$("$PY" -c 'import numpy, torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")')
echo "ci_versions: the highest versions the ranges allow: $versions (installed in $((SECONDS - start)) s)"

# The demo as a user runs it: the installed console script, from outside the source tree.
(cd "$work" && "$work/venv/bin/interlace" demo)

# The smoke subset, against the installed package (the venv's pytest puts no source tree on
# sys.path; tests/ itself is, for helpers.py): the interpreter fixes (interpreter_compat), every
# small kernel, the grouped GEMM's and persistent kernel's reference checks, and the fused
# strategy's plan and kernels in one process (the demo ran them in gloo ranks). RuntimeWarnings
# off, as in the demo: the interpreter computes masked-off lanes too (NaN there is never stored).
# Two workers, test by test (the subset's tests are independent): 42 -> 28 s on CI's 2 cores.
cd "$work/src"
"$work/venv/bin/pytest" -q -p no:cacheprovider -W ignore::RuntimeWarning -n 2 \
  tests/core/test_cpu_machine.py::test_interpreter_runtime_loop_bound_under_any_numpy \
  tests/core/test_cpu_machine.py::test_interpreter_dot_of_bf16_operands \
  tests/core/test_cpu_machine.py::test_interpreter_mask_from_a_scalar_comparison \
  tests/core/test_cpu_machine.py::test_persistent_bf16_layer_on_the_interpreter \
  tests/kernels/test_kernels.py \
  tests/kernels/test_grouped_gemm.py::test_flat_loop_gemms_match_reference \
  tests/kernels/test_grouped_gemm.py::test_joint_gate_up_matches_reference \
  tests/kernels/test_persistent_kernel.py::test_matches_reference \
  tests/strategies/test_fused.py::test_fused_matches_reference \
  tests/strategies/test_fused.py::test_plan_kernel_matches_reference \
  tests/strategies/test_fused.py::test_fused_train_one_rank
echo "ci_versions: the demo and the smoke subset passed on $versions ($((SECONDS - start)) s in all)"
