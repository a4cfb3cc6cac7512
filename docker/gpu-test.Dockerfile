# The GPU test image: a ROCm PyTorch image plus exactly the wheels under test.
# Built by `nox -s gpu-tests-<target>` (mamba2_rocm/pipeline/gputest.py) from a context that
# holds wheels/ (the target's three verified wheels: host, drop-in, kernels), tests/, pyproject.toml and gpu-test-run.sh.
# The image's torch is the one under test: it must come out of every step unchanged.

# An official ROCm PyTorch image; a runner may pass another (by digest where it can).
ARG BASE_IMAGE=rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1
# The release target (recipes/<target>.toml) and the version of the wheels in wheels/.
ARG TARGET=gfx1030
ARG VERSION=0.0.0
# The interpreter on PATH that carries the image's ROCm torch.
ARG PYTHON=python3

FROM ${BASE_IMAGE}
ARG TARGET
ARG VERSION
ARG PYTHON

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# Which interpreter has torch: record its absolute path; every later step works on it.
RUN py="$(command -v "${PYTHON}")" \
 && "${py}" -c "import torch; print('torch', torch.__version__, 'hip', torch.version.hip)" \
 && mkdir -p /opt/m2r && echo "${py}" > /opt/m2r/python

COPY wheels/ /opt/m2r/wheels/

# The guard (audit, torch fingerprint, protect-torch) runs from a venv of its own, so that
# installing it cannot touch the torch under test; it acts on the image's interpreter.
RUN "$(cat /opt/m2r/python)" -m venv /opt/m2r/guard \
 && /opt/m2r/guard/bin/pip install -q "/opt/m2r/wheels/mamba2_rocm-${VERSION}-py3-none-any.whl"

# torch.compile safety for every later step (the max-autotune variables hang ROCm's default
# compile mode), then: fingerprint torch, install our three wheels (the drop-in too: the GPU
# tests reach the kernels through the mamba_ssm / causal_conv1d names as well) and the test tools only
# through the torch-protection step, verify torch is unchanged.
RUN eval "$(/opt/m2r/guard/bin/python -m mamba2_rocm env compile-safety)" \
 && py="$(cat /opt/m2r/python)" \
 && /opt/m2r/guard/bin/python -m mamba2_rocm env fingerprint --python "${py}" --out /opt/m2r/torch-fingerprint.json \
 && /opt/m2r/guard/bin/python -m mamba2_rocm env protect-torch --python "${py}" -- -q \
      "/opt/m2r/wheels/mamba2_rocm-${VERSION}-py3-none-any.whl" \
      "/opt/m2r/wheels/mamba2_rocm_dropin-${VERSION}-py3-none-any.whl" \
      "/opt/m2r/wheels/mamba2_rocm_${TARGET//-/_}-${VERSION}-py3-none-any.whl" \
      "pytest>=8" expecttest numpy \
 && /opt/m2r/guard/bin/python -m mamba2_rocm env verify --python "${py}" /opt/m2r/torch-fingerprint.json \
 && "${py}" -c "import mamba2_rocm_${TARGET//-/_}, mamba2_rocm; print('installed', mamba2_rocm.__version__)"

# Only the tests and pytest's configuration: mamba2_rocm itself comes from the installed wheel.
COPY tests/ /opt/m2r/src/tests/
COPY pyproject.toml /opt/m2r/src/pyproject.toml
COPY --chmod=755 gpu-test-run.sh /opt/m2r/gpu-test-run.sh

# Not root: GPU access comes from the video and render groups (docker run --group-add).
RUN useradd --create-home --uid 10001 m2r
USER m2r
WORKDIR /opt/m2r/src
ENTRYPOINT ["/opt/m2r/gpu-test-run.sh"]
