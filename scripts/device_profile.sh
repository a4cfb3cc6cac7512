#!/usr/bin/env bash
# ncu summary of the conv1d kernels on the device machine (see scripts/device_check.sh).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -m mamba2_rocm build --arch native --out /tmp/m2r-kernels >/dev/null || exit 1
export MAMBA2_ROCM_KERNEL_PATH=/tmp/m2r-kernels
ncu --clock-control none -k regex:m2r_conv1d -s 3 -c 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 scripts/profile_conv1d.py > "$OUT/ncu.txt" 2>&1
grep -E "m2r_conv1d|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$OUT/ncu.txt" | head -90
