#!/usr/bin/env bash
# Drop-in acceptance on the NVIDIA machine (through the device tool). Kernels are built for the
# local GPU and the drop-in wheel is installed for real (pip, so its .pth runs at interpreter
# start). Then, in order of importance: the upstream suites (fetched copies under
# .dev/upstream/, never committed) run unmodified against the import names; transformers end
# to end; our GPU tests. Wheels the machine lacks travel in .whl/. Results under $OUT.
# EMULATE=<variant> runs all of it on an AMD target's code paths (gfx1030 is built here; the
# clang variants come prebuilt: KERNELS=.dev/emu/<variant>, see build_emulations.sh).
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
check_commit
dropin_env
python3 -m mamba2_rocm doctor >"$OUT/doctor.txt" 2>&1
grep -i -A3 "import name" "$OUT/doctor.txt"
repo=$PWD
export MAMBA2_ROCM_BACKEND=kernel  # the upstream suites must never meet a silent torch fallback
for suite in ${SUITES:-mamba causal-conv1d}; do
  cd "$repo/.dev/upstream/$suite" || continue
  timeout "${SUITE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfE --junitxml "$OUT/junit-upstream-$suite.xml" \
    ${UPSTREAM_ARGS:-} tests >"$OUT/upstream-$suite.txt" 2>&1
  echo "== upstream $suite"; tail -1 "$OUT/upstream-$suite.txt"
  if [ -n "${EMULATE:-}" ] && [ -s "$OUT/junit-upstream-$suite.xml" ]; then  # the run's record for the truth table
    (cd "$repo" && write_record "upstream-$suite" "$OUT/junit-upstream-$suite.xml" "$OUT/emulation-record-$EMULATE-upstream-$suite.json")
  fi
done
cd "$repo" || exit 1
unset MAMBA2_ROCM_BACKEND
timeout "${OURS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-tests} >"$OUT/pytest-gpu.txt" 2>&1
echo "== ours"; grep -E "passed|failed" "$OUT/pytest-gpu.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.txt" | head -30 || true  # (none found is no failure)
