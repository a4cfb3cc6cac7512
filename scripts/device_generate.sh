#!/usr/bin/env bash
# `bench generate` on the NVIDIA machine (through the device tool): kernels built for the local
# GPU, the drop-in wheel installed, the real mamba_ssm beside it (its source from
# .dev/upstream-src, never committed) so that upstream's MambaLMHeadModel on its Triton path is
# the peer. SHAPE=130m or 1.3b limits it to one shape. Results under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_lib.sh"
dropin_env
beside_upstream
timeout "${BENCH_TIMEOUT:-540}" python3 -m mamba2_rocm bench generate ${SHAPE:+--shape "$SHAPE"} --json \
  >"$OUT/generate.json" 2>"$OUT/generate.log"
echo "rc $?"; tail -5 "$OUT/generate.log"
python3 -c "import json, sys; from mamba2_rocm.bench.generate import format_table; print(format_table(json.load(open(sys.argv[1]))))" "$OUT/generate.json"
