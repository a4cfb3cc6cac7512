"""Checkpoint loading in mamba_ssm's format (``utils.hf``): ``config.json`` and
``pytorch_model.bin`` from a local directory, or from the Hugging Face Hub through
``huggingface_hub`` (an optional dependency: only needed for names that are not local)."""

from __future__ import annotations

import json
import os

import torch

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_config_hf", "load_state_dict_hf"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "pytorch_model.bin"


def _resolve(model_name: str | os.PathLike, filename: str) -> str:
    """The local file, or the Hub's cached download of it; errors name what was tried."""
    local = os.path.join(os.fspath(model_name), filename)
    if os.path.isdir(os.fspath(model_name)):
        if not os.path.isfile(local):
            raise FileNotFoundError(f"{local} not found (a checkpoint directory holds "
                                    f"{CONFIG_NAME} and {WEIGHTS_NAME})")  # fmt: skip
        return local
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise FileNotFoundError(
            f"{model_name!s} is not a local directory, and huggingface_hub (needed for Hub "
            f"names) is not installed: pip install huggingface_hub"
        ) from e
    try:
        return hf_hub_download(repo_id=str(model_name), filename=filename)
    except Exception as e:  # offline, unknown repository, missing file: say which
        raise FileNotFoundError(f"could not get {filename} of {model_name!s} from the Hugging "
                                f"Face Hub: {e}") from e  # fmt: skip


def load_config_hf(model_name: str | os.PathLike) -> dict:
    """The model's ``config.json`` as a dict."""
    with open(_resolve(model_name, CONFIG_NAME)) as f:
        return json.load(f)


def load_state_dict_hf(model_name: str | os.PathLike, device=None, dtype=None) -> dict:
    """The model's weights, converted to ``dtype`` (on the CPU first) and moved to ``device``."""
    path = _resolve(model_name, WEIGHTS_NAME)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if dtype is not None:
        state = {k: v.to(dtype=dtype) if v.is_floating_point() else v for k, v in state.items()}
    if device is not None:
        state = {k: v.to(device=device) for k, v in state.items()}
    return state
