#!/bin/bash
# The GPU test run inside the GPU test image (docker/gpu-test.Dockerfile). Reports go to $OUT:
# doctor.json, junit.xml and bench-<op>.json; gputest.py turns them into the GPU gate and keeps
# the benchmark reports.
set -euo pipefail
OUT="${OUT:-/out}"
PY="$(cat /opt/m2r/python)"
GUARD=/opt/m2r/guard/bin/python

echo "=== torch.compile safety"
eval "$("$GUARD" -m mamba2_rocm env compile-safety)"
env | grep -E '^TORCHINDUCTOR_MAX_AUTOTUNE' && { echo "max-autotune still set"; exit 1; }

echo "=== audit (python -m mamba2_rocm doctor)"
"$PY" -m mamba2_rocm doctor
"$PY" -m mamba2_rocm doctor --json > "$OUT/doctor.json"

echo "=== torch unchanged since the image was built"
"$GUARD" -m mamba2_rocm env verify --python "$PY" /opt/m2r/torch-fingerprint.json

echo "=== kernels come from the installed package"
"$PY" -m mamba2_rocm info

echo "=== pytest -m gpu"
# pytest's exit code stands: a failure stops here, and gputest.py reads junit.xml for skips.
"$PY" -m pytest -m gpu -p no:cacheprovider -q -rs --junitxml "$OUT/junit.xml" tests

echo "=== benchmarks"
for op in conv1d decode ssd; do
  "$PY" -m mamba2_rocm bench "$op" --json > "$OUT/bench-$op.json"
  "$PY" -m mamba2_rocm bench "$op"
done
# The SSD forward's host choices against their alternatives (calibrated on NVIDIA only): run
# once (it times every option at every grid point), the table printed from its report.
"$PY" -m mamba2_rocm bench ssd-paths --json > "$OUT/bench-ssd-paths.json"
"$PY" -c 'import json, sys; from mamba2_rocm.bench.ssd_paths import format_table
print(format_table(json.load(open(sys.argv[1]))))' "$OUT/bench-ssd-paths.json"
