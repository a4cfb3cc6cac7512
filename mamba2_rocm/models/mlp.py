"""``GatedMLP``: the SwiGLU feed-forward of hybrid blocks (mamba_ssm's ``modules.mlp``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """``fc2(value * activation(gate))`` with ``fc1`` producing [value | gate]; the hidden size
    (default 8/3 of the input) rounded up to ``multiple_of``."""

    def __init__(self, in_features: int, hidden_features: int | None = None,
                 out_features: int | None = None, activation=F.silu, bias: bool = False,
                 multiple_of: int = 128, device=None, dtype=None) -> None:  # fmt: skip
        super().__init__()
        out_features = in_features if out_features is None else out_features
        hidden = int(8 * in_features / 3) if hidden_features is None else hidden_features
        hidden = -(-hidden // multiple_of) * multiple_of
        self.fc1 = nn.Linear(in_features, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.fc2 = nn.Linear(hidden, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        value, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(value * self.activation(gate))
