"""The compiler driver: csrc -> one code object per source per target, plus a verified manifest.

Used by the Docker pipeline, by ``python -m mamba2_rocm build`` and by the runtime's
just-in-time path alike: one code path. Torch-free.
"""

from mamba2_rocm.build.driver import BuildError, BuildResult, build

__all__ = ["BuildError", "BuildResult", "build"]
