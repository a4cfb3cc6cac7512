#!/usr/bin/env bash
# Build the clang emulation variants (gfx11, gfx12, gfx9: csrc/mma_emu.h) for sm_90 in the
# toolchain image, with this machine's CUDA toolkit mounted (headers, ptxas), into
# ${OUT_DIR:-.dev/emu}/<variant>/sm_90. Carry that folder to the NVIDIA machine and run
#   KERNELS=.dev/emu/<variant> EMULATE=<variant> COMMIT=<sha> SKIP_BENCH=1 bash scripts/device_check.sh
# (the gfx1030 variant needs no clang: device_check.sh builds it there with EMULATE=gfx1030).
set -euo pipefail
out=${OUT_DIR:-.dev/emu}
cuda=$(realpath "${CUDA_HOME:-/usr/local/cuda}")
[ -x "$cuda/bin/ptxas" ] || { echo "no CUDA toolkit with bin/ptxas at $cuda (set CUDA_HOME)" >&2; exit 1; }
image=${MAMBA2_ROCM_TOOLCHAIN_IMAGE:-$(python3 -c 'from mamba2_rocm.pipeline.images import toolchain_image
from mamba2_rocm.pipeline.recipes import get_recipe
print(toolchain_image(get_recipe("gfx1030")))')}
for variant in ${VARIANTS:-gfx11 gfx12 gfx9}; do
  rm -rf "${out:?}/$variant" && mkdir -p "$out/$variant"
  docker run --rm --network none --user "$(id -u):$(id -g)" -v "$PWD:/src:ro" \
    -v "$cuda:/cuda:ro" -v "$(realpath "$out/$variant"):/out" -e CUDA_HOME=/cuda \
    -e PYTHONDONTWRITEBYTECODE=1 -w /src "$image" \
    python3 -m mamba2_rocm build --arch sm_90 --emulate "$variant" --out /out
done
