#!/usr/bin/env bash
# Build the kernels for the local NVIDIA GPU, run the GPU tests and the benchmark.
# Used through the device tool (the NVIDIA machine); wheels it lacks travel in .whl/.
# Results go to $OUT (or ./device-out). EMULATE=gfx1030 builds that AMD target's code paths for
# this GPU (build --emulate) and runs everything on them. KERNELS=DIR uses a kernel folder built
# elsewhere instead (the gfx11 / gfx12 emulations need clang: build them in the toolchain image
# and carry the folder here), with EMULATE naming its variant for the record.
set -uo pipefail
source "$(dirname "$0")/device_lib.sh"  # (sets $OUT)
check_commit
work=$(mktemp -d)  # fresh per run: nothing left by an earlier run lands on PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl || exit 1
  export PYTHONPATH=$work/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# mamba_ssm's Triton ops for the benchmarks' comparison column: its sdist in .whl/ (with einops'
# wheel), used from source. Its package __init__ imports the CUDA extensions, which are not
# built here, so a version-only __init__ replaces it; the ops under mamba_ssm.ops.triton are
# pure Python and import on their own. Only the benchmarks see it: on the tests' path a real
# mamba_ssm would take the name from the drop-in (which gives way to real packages).
peers=
for sdist in .whl/mamba_ssm-*.tar.gz; do
  [ -e "$sdist" ] || break
  mkdir -p "$work/mamba-ssm-src" && tar xzf "$sdist" -C "$work/mamba-ssm-src" || exit 1
  src=$(echo "$work"/mamba-ssm-src/mamba_ssm-*)
  echo "__version__ = \"$(basename "$src" | sed 's/^mamba_ssm-//')\"  # CUDA extensions not built" > "$src/mamba_ssm/__init__.py"
  peers=$src
done
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' | tee -a "$OUT/gpu.txt"
select_kernels "$work/kernels"
cat "$OUT/build.txt"
export MAMBA2_ROCM_KERNEL_PATH=$kernels
python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/junit-gpu.xml" tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -40
if [ -n "${EMULATE:-}" ]; then  # the run's record for the truth table (commit it under records/emulation/)
  write_record gpu "$OUT/junit-gpu.xml" "$OUT/emulation-record-$EMULATE.json"
fi
echo "--- just-in-time path (empty kernel path, fresh cache) ---"
MAMBA2_ROCM_KERNEL_PATH= MAMBA2_ROCM_CACHE=$work/jit python3 - <<'PY' 2>&1 | tee "$OUT/jit.txt"
import torch, warnings
warnings.simplefilter("always")
from mamba2_rocm import causal_conv1d_fn
from mamba2_rocm.runtime.loader import kernels_for_device
x = torch.randn(1, 64, 100, device="cuda"); w = torch.randn(64, 4, device="cuda")
y = causal_conv1d_fn(x, w)
k = kernels_for_device(0)
print("jit kernel dir:", k.kdir.path, "origin:", k.kdir.origin)
PY
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for b in ${BENCHES:-conv1d decode ssd rmsnorm selective-scan host}; do
    PYTHONPATH=$PYTHONPATH${peers:+:$peers} python3 -m mamba2_rocm bench "$b" 2>&1 | tee "$OUT/bench-$b.txt"
  done
fi
