"""``mamba_ssm.modules.mamba3``: not provided by mamba2-rocm (importing it says why)."""

from mamba2_rocm.models.lm import NOT_PROVIDED

raise ImportError(f"mamba_ssm.modules.mamba3 is not provided by mamba2-rocm's drop-in: "
                  f"{NOT_PROVIDED['Mamba3']}", name="mamba_ssm.modules.mamba3")  # fmt: skip
