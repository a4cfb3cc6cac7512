"""Regenerate tests/data/upstream_state_dicts.json: the state_dict keys and shapes of
mamba_ssm's own models, built on the CPU from upstream's source, for the configurations
tests/test_models.py builds ours with (structural parity: checkpoints saved by upstream load
into ours with strict=True).

    PYTHONPATH=<mamba checkout>:<site with triton, einops> python scripts/upstream_state_dicts.py \
        --commit <its sha> > tests/data/upstream_state_dicts.json

Upstream imports Triton at module import (no GPU is needed to build the modules).
"""

from __future__ import annotations

import argparse
import json
import sys

#: name -> (what is built, its keyword arguments); JSON-able so the test rebuilds them
CONFIGS = {
    "lm-mamba1": ("lm", {"d_model": 64, "n_layer": 2, "vocab_size": 1000,
                         "ssm_cfg": {"layer": "Mamba1"}, "pad_vocab_size_multiple": 16}),
    "lm-mamba2": ("lm", {"d_model": 64, "n_layer": 2, "vocab_size": 1000,
                         "ssm_cfg": {"layer": "Mamba2", "headdim": 16, "d_state": 32, "ngroups": 2},
                         "pad_vocab_size_multiple": 16}),
    "lm-hybrid": ("lm", {"d_model": 64, "n_layer": 3, "d_intermediate": 96, "vocab_size": 1000,
                         "ssm_cfg": {"layer": "Mamba2", "headdim": 16, "d_state": 16},
                         "attn_layer_idx": [1], "attn_cfg": {"num_heads": 4, "num_heads_kv": 2,
                                                             "causal": True, "d_conv": 4,
                                                             "mlp_dim": 64},
                         "rms_norm": False, "fused_add_norm": False, "tie_embeddings": False}),
    "mamba2-mlp-hdim": ("Mamba2", {"d_model": 64, "d_ssm": 64, "headdim": 16, "d_state": 16,
                                   "D_has_hdim": True, "bias": True, "layer_idx": 0}),
    "mamba2-no-norm": ("Mamba2", {"d_model": 64, "headdim": 32, "rmsnorm": False,
                                  "conv_bias": False, "layer_idx": 0}),
    "mamba1-bias": ("Mamba", {"d_model": 48, "d_state": 8, "dt_rank": 5, "bias": True,
                              "conv_bias": False}),
    "mamba2-simple": ("Mamba2Simple", {"d_model": 64, "headdim": 32, "d_state": 16,
                                       "learnable_init_states": True}),
}  # fmt: skip


#: the seed the weights' digest is taken at (same seed, same draws: same weights as upstream)
SEED = 5


def weights_digest(sd) -> str:
    """sha256 over the state_dict's tensors in key order (their float32 bytes)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def build(kind: str, kwargs: dict, ns):
    if kind == "lm":
        return ns.MambaLMHeadModel(ns.MambaConfig(**kwargs))
    return getattr(ns, kind)(**kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the upstream commit the keys come from")
    args = ap.parse_args()
    from types import SimpleNamespace

    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from mamba_ssm.modules.mamba2 import Mamba2
    from mamba_ssm.modules.mamba2_simple import Mamba2Simple
    from mamba_ssm.modules.mamba_simple import Mamba

    ns = SimpleNamespace(MambaConfig=MambaConfig, MambaLMHeadModel=MambaLMHeadModel,
                         Mamba2=Mamba2, Mamba2Simple=Mamba2Simple, Mamba=Mamba)  # fmt: skip
    import torch

    out = {"upstream": "state-spaces/mamba", "commit": args.commit, "torch": torch.__version__,
           "seed": SEED, "models": {}}  # fmt: skip
    for name, (kind, kwargs) in CONFIGS.items():
        import torch

        torch.manual_seed(SEED)
        sd = build(kind, kwargs, ns).state_dict()
        out["models"][name] = {"kind": kind, "kwargs": kwargs,
                               "state_dict": {k: list(v.shape) for k, v in sd.items()},
                               "seeded_weights_sha256": weights_digest(sd)}  # fmt: skip
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
