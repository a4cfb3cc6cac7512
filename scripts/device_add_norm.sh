#!/usr/bin/env bash
# The fused add + norm kernels on the NVIDIA machine (through the device tool): kernels built for
# the local GPU, the drop-in wheel installed for real, then
#   1. tests/gpu/test_add_norm_gpu.py and the model GPU tests (Block / MixerModel call the norm);
#   2. beside the real mamba_ssm (its source from .dev/upstream-src, never committed, so that
#      its Triton rms_norm_fn is the peer): `bench add-norm` forward and --backward.
# Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
dropin_env
run() {  # run NAME PYTEST-ARGS...: its summary and failures echoed
  local name=$1; shift
  timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rfE "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name: $(tail -1 "$OUT/$name.txt")"
  grep -E "^(FAILED|ERROR) |Error:|assert" "$OUT/$name.txt" | head -30 || true
}
run add-norm-gpu -m gpu tests/gpu/test_add_norm_gpu.py
run models-gpu -m gpu tests/gpu/test_models_gpu.py
[ "${BENCH:-1}" = 1 ] || exit 0
beside_upstream
for mode in "" --backward; do
  timeout 300 python3 -m mamba2_rocm bench add-norm $mode 2>&1 | tee -a "$OUT/bench.txt"
done
