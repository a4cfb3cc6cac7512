"""``mamba_ssm.ops.selective_scan_interface`` (mamba2-rocm drop-in facade).

The Mamba1 selective scan has no kernel yet: its names raise ImportError saying so, and
transformers' lookup takes its own fallback rather than a stand-in dressed as a kernel.
"""

from mamba2_rocm.dropin import missing

__all__: list[str] = []
__getattr__ = missing(
    "mamba_ssm.ops.selective_scan_interface",
    {
        name: "the Mamba1 selective scan has no kernel yet"
        for name in ("selective_scan_fn", "mamba_inner_fn", "selective_scan_ref", "mamba_inner_ref")
    },
)
