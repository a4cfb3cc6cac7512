#!/usr/bin/env bash
# Build the ROCm compiler image from Debian's archive when it is not already present.
#
# No registry is reachable on our machines, so the root filesystem is bootstrapped with
# mmdebstrap (Debian unstable carries hipcc 7.0.2 / clang 21 with HIP 6.4 device libraries)
# and imported. SOURCE_DATE_EPOCH makes the rootfs bit-reproducible; DEBIAN_MIRROR may point
# at snapshot.debian.org to replay an old build. The image holds no PyTorch: the build driver
# only needs python3 with msgpack and pyelftools.
#
#   docker/bootstrap-toolchain.sh [IMAGE]      (default: mamba2-rocm-toolchain:latest)
set -euo pipefail
IMAGE=${1:-${MAMBA2_ROCM_TOOLCHAIN_IMAGE:-mamba2-rocm-toolchain:latest}}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-unstable}
PACKAGES=hipcc,libamdhip64-dev,python3,python3-msgpack,python3-pyelftools,python3-packaging
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1763683200}  # 2025-11-21, fixed for reproducibility

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "toolchain image $IMAGE already present"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "bootstrapping $SUITE from $MIRROR with $PACKAGES"
# unstable's Release file on mirrors can be past its validity date: accept it (signatures are still checked)
mmdebstrap --variant=apt --aptopt='Acquire::Check-Valid-Until "false"' \
  --include="$PACKAGES" --format=tar "$SUITE" "$tmp/rootfs.tar" "$MIRROR"
docker import --change 'ENV HIP_PLATFORM=amd' "$tmp/rootfs.tar" "$IMAGE"
docker run --rm "$IMAGE" hipcc --version | head -3
