# The ROCm compiler image: Debian's hipcc / clang / lld / device libraries at the versions a
# recipe pins, python3 for the build driver, and no PyTorch. Built by
# `python -m mamba2_rocm.pipeline toolchain` (mamba2_rocm/pipeline/images.py), which passes the
# pins from recipes/<target>.toml. Compilation then runs in it with --network none.

# The base rootfs: a local image, a pulled debian:<suite>-slim, or one bootstrapped with
# mmdebstrap (no registry reachable); images.py decides.
ARG BASE_IMAGE=mamba2-rocm-base:unstable
# A snapshot.debian.org URL here replays an old build exactly.
ARG DEBIAN_MIRROR=http://deb.debian.org/debian
ARG DEBIAN_SUITE=unstable
# "name=version ..." from the recipe's [toolchain] packages.
ARG PACKAGES=""
ARG BUILDER_UID=1000

FROM ${BASE_IMAGE}
ARG DEBIAN_MIRROR
ARG DEBIAN_SUITE
ARG PACKAGES
ARG BUILDER_UID

# One step: sources, index, pin check, install, clean lists. Unstable's Release file on mirrors
# can be past its Valid-Until date; signatures are still verified.
RUN set -eu; \
    rm -f /etc/apt/sources.list.d/*; \
    printf 'deb %s %s main\n' "$DEBIAN_MIRROR" "$DEBIAN_SUITE" > /etc/apt/sources.list; \
    apt-get -o Acquire::Check-Valid-Until=false update -qq; \
    missing=""; \
    for pin in $PACKAGES; do \
      name=${pin%%=*}; version=${pin#*=}; \
      apt-cache madison "$name" | awk -F'|' '{gsub(/ /, "", $2); print $2}' | grep -qxF "$version" \
        || missing="$missing $name=$version"; \
    done; \
    if [ -n "$missing" ]; then \
      echo "error: pinned toolchain package version(s) not available from $DEBIAN_MIRROR $DEBIAN_SUITE:$missing" >&2; \
      echo "       update the pins in recipes/*.toml, or point DEBIAN_MIRROR at a snapshot.debian.org date that has them" >&2; \
      exit 1; \
    fi; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      $PACKAGES python3 python3-msgpack python3-pyelftools python3-packaging python3-platformdirs >/dev/null; \
    rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid "${BUILDER_UID}" builder
ENV HIP_PLATFORM=amd PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
USER builder
