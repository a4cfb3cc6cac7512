#!/usr/bin/env bash
# mamba_ssm's compiled selective scan (module `selective_scan_cuda`) built for the local NVIDIA
# GPU, to be the peer of `bench selective-scan` (forward) and `bench selective-scan --backward`
# (issue #72). It never builds on ROCm and is never shipped: only the NVIDIA machine has it.
#
#   SRC=.dev/upstream-csrc/csrc/selective_scan bash scripts/build_cuda_peer.sh OUT_DIR
#
# SRC: the csrc/selective_scan folder of a fetched state-spaces/mamba tree (never committed).
# Built with torch.utils.cpp_extension (ninja: its wheel travels in .whl/) for this GPU's arch
# only, into OUT_DIR (a finished build there is reused). The last line of the output is the
# folder to put on the import path.
set -euo pipefail
src=$(cd "${SRC:?set SRC to a fetched csrc/selective_scan}" && pwd)
out=${1:?usage: SRC=... build_cuda_peer.sh OUT_DIR}
mkdir -p "$out"
if [ ! -f "$out/selective_scan_cuda.so" ]; then
  export PATH=$(python3 -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null || echo /nonexistent):$PATH
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  python3 - "$src" "$out" <<'PY'
import glob
import sys

import torch
from torch.utils.cpp_extension import load

src, out = sys.argv[1:3]
major, minor = torch.cuda.get_device_capability()
arch = f"{major}{minor}"
sources = [f"{src}/selective_scan.cpp", *sorted(glob.glob(f"{src}/selective_scan_*.cu"))]
# the flags mamba_ssm's setup.py builds this extension with, for one arch
flags = ["-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr",
         "--expt-extended-lambda", f"-gencode=arch=compute_{arch},code=sm_{arch}",
         *(f"-U__CUDA_NO_{t}_{k}__" for t in ("HALF", "BFLOAT16", "BFLOAT162")
           for k in ("OPERATORS", "CONVERSIONS"))]
load("selective_scan_cuda", sources, extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=flags,
     build_directory=out, verbose=False)
print(f"built selective_scan_cuda for sm_{arch}", file=sys.stderr)
PY
fi
echo "$out"
