#!/usr/bin/env bash
# The open tuning questions of #70 / #72 in one call on the NVIDIA machine (through the device
# tool): kernels built for the local GPU, then
#   1. the SSD backward's dcb head parts (scripts/tune_ssd_bwd_dcb.py, PARTS="1 auto 2 4 8");
#   2. the Mamba1 forward's lane forms at the narrow widths (scripts/tune_selective_scan.py,
#      SPLIT=1 / 2 / 4);
#   3. the decode step's weight prefetch always / never / by its rule, graph decode of a
#      1.3b-like model at batch 16 and 1 (scripts/tune_prefetch.py);
#   4. scan: chunk_scan build knobs (SCAN_KNOBS, e.g. "SPLIT_SCAN":
#      -DM2R_SSD_<knob>=1, csrc/ssd_common.h), each one source rebuilt and laid over the build with
#      mamba2_rocm.build.overlay, against the default by scripts/profile_ssd.py in alternating
#      rounds; then the SSD, non-finite and matrix-core probe GPU tests and `bench ssd-error` on
#      each variant (Triton's column where .dev/upstream-src holds mamba_ssm's source).
# STEPS="dcb lanes prefetch scan" limits the set. Results under $OUT (sweep.txt, build.txt).
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
  scan)
    dirs=("$kernels")
    [ -n "${SCAN_KNOBS:-}" ] || { echo "scan: set SCAN_KNOBS (e.g. SPLIT_SCAN)" | tee -a "$OUT/sweep.txt"; continue; }
    for knob in $SCAN_KNOBS; do
      python3 -m mamba2_rocm build --arch native --source ssd_chunk_scan --extra-flag="-DM2R_SSD_$knob=1" \
        --out "$work/src-$knob" >>"$OUT/build.txt" 2>&1 &&
        python3 -m mamba2_rocm.build.overlay "$kernels" "$work/src-$knob" "$work/$knob" | tee -a "$OUT/sweep.txt" &&
        dirs+=("$work/$knob")
    done
    shapes=${SSD_SHAPES:-issue-g1 issue-g8 mamba2-130m mamba2-2.7b nemotron-h falcon-h1 codestral-b8}
    for round in 1 2; do
      for k in "${dirs[@]}"; do
        # shellcheck disable=SC2086  # shapes is a list
        MAMBA2_ROCM_KERNEL_PATH=$k timeout 120 python3 scripts/profile_ssd.py $shapes 2>&1 | grep -v -i warn |
          sed "s|^|[round $round $(basename "$k")] |" | tee -a "$OUT/sweep.txt"
      done
    done
    for k in "${dirs[@]:1}"; do
      MAMBA2_ROCM_KERNEL_PATH=$k timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -rfE \
        tests/gpu/test_ssd_gpu.py tests/gpu/test_nonfinite_gpu.py tests/gpu/test_mma_probe_gpu.py \
        tests/gpu/test_bench_error_gpu.py 2>&1 | tail -5 | sed "s|^|[$(basename "$k")] |" | tee -a "$OUT/sweep.txt"
      ( [ -d .dev/upstream-src ] && beside_upstream
        MAMBA2_ROCM_KERNEL_PATH=$k timeout 200 python3 -m mamba2_rocm bench ssd-error 2>&1 | grep -v -i warn |
          sed "s|^|[$(basename "$k")] |" | tee -a "$OUT/sweep.txt" )
    done ;;
  *) echo "unknown step $step" | tee -a "$OUT/sweep.txt" ;;
  esac
done
