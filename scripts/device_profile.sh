#!/usr/bin/env bash
# ncu summary of some kernels on the device machine (see scripts/device_check.sh).
#   KERNELS  ncu kernel-name regex              (default m2r_conv1d)
#   SCRIPT   the python command line profiled    (default scripts/profile_conv1d.py)
#   SKIP / COUNT  launches of matching kernels skipped / profiled (default 3 / 3)
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
work=$(mktemp -d)  # fresh per run: nothing left by an earlier run lands on PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$work/site PYTHONUNBUFFERED=1
python3 -m mamba2_rocm build --arch native --out "$work/kernels" >/dev/null || exit 1
export MAMBA2_ROCM_KERNEL_PATH=$work/kernels
KERNELS=${KERNELS:-m2r_conv1d} SCRIPT=${SCRIPT:-scripts/profile_conv1d.py}
# shellcheck disable=SC2086  # SCRIPT is a command line
ncu --clock-control none -k "regex:$KERNELS" -s "${SKIP:-3}" -c "${COUNT:-3}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
  --section SourceCounters --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 $SCRIPT > "$OUT/ncu.txt" 2>&1
grep -E "m2r_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issue Slots|Executed Ipc|Executed Instructions|stalled|Warp Stall|Uncoalesced|Bank" "$OUT/ncu.txt" | head -200
