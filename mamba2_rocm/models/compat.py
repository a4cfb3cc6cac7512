"""Small helpers code written for mamba_ssm imports from its ``utils`` package.

- ``custom_fwd`` / ``custom_bwd`` (``mamba_ssm.utils.torch``): torch's autocast decorators for
  an ``autograd.Function``'s forward / backward, with the device type defaulting to the GPU's
  ("cuda": what torch calls ROCm devices too), usable bare (``@custom_fwd``) or with keywords
  (``@custom_fwd(cast_inputs=torch.float32)``), as upstream's are.
- ``use_deterministic_mode`` / ``set_deterministic_mode`` (``mamba_ssm.utils.determinism``):
  upstream's switch for its Triton kernels' reproducible paths (``MAMBA_DETERMINISTIC=1``, or
  torch's deterministic algorithms). mamba2-rocm's kernels reduce in a fixed order and are
  bit-identical run to run in either mode; the switch is kept so code that sets or reads it runs.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["custom_bwd", "custom_fwd", "set_deterministic_mode", "use_deterministic_mode"]

_DEVICE = "cuda"


def _amp(decorator):
    def wrapper(fn=None, /, **kwargs):
        kwargs.setdefault("device_type", _DEVICE)
        if fn is None:  # @custom_fwd(cast_inputs=...)
            return functools.partial(decorator, **kwargs)
        return decorator(fn, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = decorator.__name__
    wrapper.__doc__ = f"torch.amp.{decorator.__name__} with device_type defaulting to 'cuda'."
    return wrapper


custom_fwd = _amp(torch.amp.custom_fwd)
custom_bwd = _amp(torch.amp.custom_bwd)

_override: bool | None = None


def use_deterministic_mode() -> bool:
    """The override set by :func:`set_deterministic_mode`, else ``MAMBA_DETERMINISTIC`` (its
    first character "1"), else whether torch's deterministic algorithms are on."""
    if _override is not None:
        return _override
    env = os.environ.get("MAMBA_DETERMINISTIC")
    if env:
        return env.startswith("1")
    return torch.are_deterministic_algorithms_enabled()


def set_deterministic_mode(value: bool | None) -> None:
    """Set (True / False) or clear (None) the override :func:`use_deterministic_mode` reads."""
    global _override
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"set_deterministic_mode takes True, False or None, got {value!r}")
    _override = value
