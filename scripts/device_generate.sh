#!/usr/bin/env bash
# `bench generate` on the NVIDIA machine (through the device tool): kernels built for the local
# GPU, the drop-in wheel installed, the real mamba_ssm beside it (its source from
# .dev/upstream-src, never committed) so that upstream's MambaLMHeadModel on its Triton path is
# the peer. Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
dropin_env
beside_upstream
# one process per shape, each with its own time limit and JSON (a shape that runs out of time
# leaves the others' results): SHAPES="130m:240 1.3b:300" (shape:seconds)
for item in ${SHAPES:-130m:240 1.3b:300}; do
  shape=${item%%:*} limit=${item##*:}
  timeout "$limit" python3 -m mamba2_rocm bench generate --shape "$shape" --json \
    >"$OUT/generate-$shape.json" 2>"$OUT/generate-$shape.log"
  echo "== $shape: rc $?"; tail -3 "$OUT/generate-$shape.log"
  python3 -c "import json, sys; from mamba2_rocm.bench.generate import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
    "$OUT/generate-$shape.json" 2>/dev/null
done
