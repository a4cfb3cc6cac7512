"""mamba_ssm's models on mamba2-rocm's kernels: the mixers (``Mamba``, ``Mamba2``,
``Mamba2Simple``, ``MHA``, ``GatedMLP``), ``Block``, ``MixerModel`` / ``MambaLMHeadModel``
with ``MambaConfig``, generation with ``InferenceParams``, and tensor parallelism.

The same constructor arguments, attribute names and ``state_dict`` keys as mamba_ssm 2.3.x,
so upstream checkpoints load with ``strict=True``; importable here without the drop-in, and
under upstream's paths through it (``mamba_ssm.models.mixer_seq_simple`` and so on).
"""

from mamba2_rocm.models.block import Block
from mamba2_rocm.models.config import MambaConfig
from mamba2_rocm.models.generation import GenerationMixin, InferenceParams
from mamba2_rocm.models.lm import MambaLMHeadModel, MixerModel, create_block
from mamba2_rocm.models.mamba1 import Mamba
from mamba2_rocm.models.mamba2 import Mamba2
from mamba2_rocm.models.mamba2_simple import Mamba2Simple
from mamba2_rocm.models.mha import MHA
from mamba2_rocm.models.mlp import GatedMLP

__all__ = [
    "MHA",
    "Block",
    "GatedMLP",
    "GenerationMixin",
    "InferenceParams",
    "Mamba",
    "Mamba2",
    "Mamba2Simple",
    "MambaConfig",
    "MambaLMHeadModel",
    "MixerModel",
    "create_block",
]
