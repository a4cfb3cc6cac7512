# Shared by the device_*.sh scripts (sourced): $OUT, the emulation run's commit check, the kernel
# folder a run uses, the record an emulation run writes for records/emulation/, and the drop-in
# installed alone or beside the real mamba_ssm.

# Results go to $OUT (the device tool's, else ./device-out) for every script that sources this.
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"

# A run that writes records must name the full sha they will carry.
check_commit() {
  if [ -n "${EMULATE:-}" ] && [ -n "${COMMIT:-}" ] && ! [[ $COMMIT =~ ^[0-9a-f]{40}$ ]]; then
    echo "COMMIT must be the full 40-hex sha the run's record names, got '$COMMIT'" >&2; exit 2
  fi
}

# Sets $kernels: KERNELS (a folder built elsewhere, e.g. the clang emulations of
# build_emulations.sh; refused unless it is EMULATE's build), else a fresh build for this GPU
# under $1. The build's output goes to $OUT/build.txt.
select_kernels() {
  if [ -n "${KERNELS:-}" ]; then
    kernels=$(cd "$KERNELS" && pwd) || exit 1
    python3 -m mamba2_rocm.pipeline emulation-kernels --variant "${EMULATE:-}" "$kernels" | tee "$OUT/build.txt" || exit 1
  else
    kernels=$1
    python3 -m mamba2_rocm build --arch native ${EMULATE:+--emulate "$EMULATE"} --out "$kernels" >"$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
  fi
}

# write_record SUITE JUNIT OUT: the emulation record of one suite's run (run from the repo root)
write_record() {
  python3 -m mamba2_rocm.pipeline emulation-record --variant "$EMULATE" --suite "$1" --junit "$2" \
    --commit "${COMMIT:-$(git rev-parse HEAD)}" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --out "$3"
}

# dropin_env: pure-Python wheels from .whl/ into a fresh site, kernels for this GPU
# (select_kernels), and the drop-in wheel installed for real (its .pth runs at interpreter
# start). Sets $work, $kernels, PYTHONPATH and MAMBA2_ROCM_KERNEL_PATH.
dropin_env() {
  work=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:$work/site PYTHONUNBUFFERED=1
  nvidia-smi -L | tee "$OUT/gpu.txt"
  select_kernels "$work/kernels"
  export MAMBA2_ROCM_KERNEL_PATH=$kernels
  # the drop-in wheel: built here when hatchling is there, else carried in .dev/dist/
  local dist=.dev/dist
  if ! ls $dist/mamba2_rocm_dropin-*.whl >/dev/null 2>&1; then
    dist=$work/dist
    python3 -c "import sys; from pathlib import Path; from mamba2_rocm.pipeline.package import build_dropin_wheel; build_dropin_wheel('0.0.0', Path(sys.argv[1]), '1700000000')" "$dist" || exit 1
  fi
  python3 -m pip install -q --no-index --no-deps "$dist"/mamba2_rocm_dropin-*.whl || exit 1
}

# beside_upstream: the real mamba_ssm (the fetched source in .dev/upstream-src, never
# committed) first on the import path; the drop-in then serves only what it cannot build.
beside_upstream() {
  export PYTHONPATH=$PWD/.dev/upstream-src:$PYTHONPATH
}

# cuda_peer (after dropin_env, which makes $work): mamba_ssm's compiled selective scan built for
# this GPU (scripts/build_cuda_peer.sh)
# from a fetched tree's csrc/selective_scan (.dev/upstream-csrc, never committed) and put on
# PYTHONPATH ahead of the drop-in's facade of that name: bench selective-scan's peer. Without
# the sources, nothing (the bench then has no CUDA column).
cuda_peer() {
  local src=$PWD/.dev/upstream-csrc/csrc/selective_scan dir
  [ -d "$src" ] || { echo "no $src: bench selective-scan runs without its CUDA peer"; return 0; }
  dir=$(SRC=$src bash scripts/build_cuda_peer.sh "$work/cuda-peer" 2>"$OUT/cuda-peer-build.txt" | tail -1) \
    || { echo "the CUDA peer did not build (see cuda-peer-build.txt)"; tail -5 "$OUT/cuda-peer-build.txt"; return 0; }
  export PYTHONPATH=$PYTHONPATH:$dir
}
