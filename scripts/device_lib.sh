# Shared by device_check.sh and device_compat.sh (sourced): the emulation run's commit check, the
# kernel folder a run uses, and the record an emulation run writes for records/emulation/.

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
