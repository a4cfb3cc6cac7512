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
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_lib.sh"
dropin_env
repo=$PWD
run() {  # run NAME DIR PYTEST-ARGS...: pytest in DIR, summary line echoed
  local name=$1 dir=$2; shift 2
  (cd "$dir" && timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rfE \
    --junitxml "$OUT/junit-$name.xml" "$@" >"$OUT/$name.txt" 2>&1)
  echo "== $name: $(tail -1 "$OUT/$name.txt")"
}
echo "## setup: drop-in alone"
python3 -m mamba2_rocm doctor 2>&1 | sed -n '/import names/,/^environment/p' | tee "$OUT/doctor-alone.txt"
run generation-alone "$repo/.dev/upstream/mamba" tests/test_generation.py
run models-gpu "$repo" -m gpu tests/gpu/test_models_gpu.py
echo "## setup: beside the real mamba_ssm"
beside_upstream
python3 -m mamba2_rocm doctor 2>&1 | sed -n '/import names/,/^environment/p' | tee "$OUT/doctor-beside.txt"
run generation-beside "$repo/.dev/upstream/mamba" tests/test_generation.py
run selective-scan-beside "$repo/.dev/upstream/mamba" tests/ops/test_selective_scan.py
timeout 400 python3 scripts/model_parity.py --out "$OUT/parity.json" 2>&1 | tail -20 | tee "$OUT/parity.txt"
