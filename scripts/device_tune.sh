#!/usr/bin/env bash
# The open tuning questions of #70 / #72 in one call on the NVIDIA machine (through the device
# tool): kernels built for the local GPU, then
#   1. the SSD backward's dcb head parts (scripts/tune_ssd_bwd_dcb.py, PARTS="1 auto 2 4 8");
#   2. the Mamba1 forward's lane forms at the narrow widths (scripts/tune_selective_scan.py,
#      SPLIT=1 / 2 / 4);
#   3. the decode step's weight prefetch always / never / by its rule, graph decode of a
#      1.3b-like model at batch 16 and 1 (scripts/tune_prefetch.py).
# STEPS="dcb lanes prefetch" limits the set. Results under $OUT (sweep.txt, build.txt).
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
work=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" .whl/*.whl || exit 1
  export PYTHONPATH=$work/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAMBA2_ROCM_BACKEND=kernel
nvidia-smi -L | tee "$OUT/sweep.txt"
select_kernels "$work/kernels"
export MAMBA2_ROCM_KERNEL_PATH=$kernels
narrow="1,768,2048,16 1,1536,2048,16 1,2048,2048,16 8,768,2048,16 8,2048,2048,16 8,4096,2048,16"
for step in ${STEPS:-dcb lanes prefetch}; do
  echo "== $step" | tee -a "$OUT/sweep.txt"
  case $step in
  dcb) timeout 300 python3 scripts/tune_ssd_bwd_dcb.py 2>&1 | tee -a "$OUT/sweep.txt" ;;
  lanes)
    for split in 1 2 4; do
      SPLIT=$split SEGMENTS=auto SHAPES="$narrow" timeout 120 python3 scripts/tune_selective_scan.py 2>&1 |
        sed "s/^/SPLIT=$split /" | tee -a "$OUT/sweep.txt"
    done ;;
  prefetch) timeout 300 python3 scripts/tune_prefetch.py 2>&1 | tee -a "$OUT/sweep.txt" ;;
  *) echo "unknown step $step" | tee -a "$OUT/sweep.txt" ;;
  esac
done
