#!/usr/bin/env bash
# The model layer's acceptance on the NVIDIA machine (through the device tool): kernels built
# for the local GPU, the drop-in wheel installed for real, then
#   1. drop-in alone: upstream's tests/test_generation.py unmodified, and our GPU model tests;
#   2. beside the real mamba_ssm (its source from .dev/upstream-src, never committed):
#      test_generation.py again, upstream's tests/ops/test_selective_scan.py (its
#      selective_scan_fn and mamba_inner_fn over our selective_scan_cuda and conv), and
#      scripts/model_parity.py (ours against upstream's modules with the same weights).
# Upstream's tests come from .dev/upstream/mamba (a fetch). Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
dropin_env
repo=$PWD
run() {  # run NAME DIR PYTEST-ARGS...: pytest in DIR; its summary and failures echoed
  local name=$1 dir=$2; shift 2
  (cd "$dir" && timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rfE \
    "$@" >"$OUT/$name.txt" 2>&1)
  echo "== $name: $(tail -1 "$OUT/$name.txt")"
  grep -E "^(FAILED|ERROR) " "$OUT/$name.txt" | head -20 || true
}
# OPS=1 also runs the upstream ops suites in each setup (mamba's tests/ops without Mamba3,
# whose kernels are CUDA-only; causal-conv1d's tests)
ops_suites() {  # ops_suites SETUP
  [ "${OPS:-0}" = 1 ] || return 0
  run "mamba-ops-$1" "$repo/.dev/upstream/mamba" tests/ops --ignore=tests/ops/cute \
    --ignore=tests/ops/tilelang --ignore=tests/ops/triton/test_mamba3_siso.py
  run "causal-conv1d-$1" "$repo/.dev/upstream/causal-conv1d" tests
}
echo "## setup: drop-in alone"
python3 -m mamba2_rocm doctor 2>&1 | sed -n '/import names/,/^environment/p' | tee "$OUT/doctor.txt"
run generation-alone "$repo/.dev/upstream/mamba" tests/test_generation.py
run models-gpu "$repo" -m gpu tests/gpu/test_models_gpu.py \
  tests/gpu/test_ssd_gpu.py::test_varlen_states tests/gpu/test_ssd_gpu.py::test_varlen_states_with_a_padded_tail
ops_suites alone
echo "## setup: beside the real mamba_ssm"
beside_upstream
python3 -m mamba2_rocm doctor 2>&1 | sed -n '/import names/,/^environment/p' | tee -a "$OUT/doctor.txt"
run generation-beside "$repo/.dev/upstream/mamba" tests/test_generation.py
run selective-scan-beside "$repo/.dev/upstream/mamba" tests/ops/test_selective_scan.py
ops_suites beside
[ "${PARITY:-1}" = 1 ] && timeout 400 python3 scripts/model_parity.py --out "$OUT/parity.json" 2>&1 | tail -20
