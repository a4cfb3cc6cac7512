#!/usr/bin/env bash
# Every benchmark as a record (records/bench/, docs/performance.md's source) on the NVIDIA machine
# (through the device tool): kernels built for the local GPU, the drop-in installed, the real
# mamba_ssm beside it (its source from .dev/upstream-src, never committed) so that its Triton ops
# are the peers, and its compiled selective scan (built here from .dev/upstream-csrc when that
# came along: scripts/build_cuda_peer.sh). Each bench runs with --record under its own time
# limit; the records come back as one archive, $OUT/records.tgz (unpack it at the repository
# root, then run `python -m mamba2_rocm.bench.records` and commit both). BENCHES="op[:flags],..." limits the set.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
dropin_env
beside_upstream
cuda_peer  # (mamba_ssm's compiled scan, where its sources came along: .dev/upstream-csrc)
default="conv1d conv1d:--backward decode ssd ssd:--backward ssd-error rmsnorm rmsnorm:--backward add-norm add-norm:--backward selective-scan selective-scan:--backward linear generate model"
for spec in ${BENCHES:-$default}; do
  op=${spec%%:*} flags=""
  [ "$op" != "$spec" ] && flags=${spec#*:}
  echo "== bench $op $flags" | tee -a "$OUT/bench.txt"
  timeout "${BENCH_TIMEOUT:-300}" python3 -m mamba2_rocm bench "$op" $flags --record >>"$OUT/bench.txt" 2>&1
  echo "rc $?" | tee -a "$OUT/bench.txt"
done
tar czf "$OUT/records.tgz" records/bench
ls records/bench
