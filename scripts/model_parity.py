"""Our MambaLMHeadModel against mamba_ssm's own, with the same weights, on a GPU.

Run beside the real mamba_ssm (its source on PYTHONPATH, the drop-in installed: upstream's
modules then run their Triton SSD, state update and norms, with our conv / scan under them,
since causal-conv1d and selective_scan_cuda do not build here). Per config (Mamba1, Mamba2,
hybrid with attention and an MLP; fp32): max |logits ours - upstream| over max |upstream|,
the worst parameter gradient's relative difference, ours' generate(cg=True) scores against
its full forward, and a short training run of both from the same init (loss per step).

    PYTHONPATH=$PWD:<dir holding mamba_ssm> python scripts/model_parity.py --out parity.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

CONFIGS = {
    "mamba1": dict(ssm_cfg={"layer": "Mamba1"}),
    "mamba2": dict(ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 64, "chunk_size": 64}),
    "hybrid": dict(ssm_cfg={"layer": "Mamba2", "headdim": 32, "d_state": 64, "chunk_size": 64},
                   attn_layer_idx=[1], attn_cfg={"num_heads": 8, "causal": True},
                   d_intermediate=512),
}  # fmt: skip
COMMON = dict(d_model=256, n_layer=4, vocab_size=1000, pad_vocab_size_multiple=16)


def grads_of(model, x):
    model.zero_grad(set_to_none=True)
    logits = model(x).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train(model, steps: int, seed: int) -> list[float]:
    """AdamW on one fixed batch (8 sequences, each a random 16-token motif repeated): a task a
    model fits within a few dozen steps, so both loss curves must fall, and together."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, 1000, (8, 16), device="cuda", generator=g).repeat(1, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(steps):
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    import mamba_ssm
    from mamba_ssm.models.config_mamba import MambaConfig as UpConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as Upstream

    from mamba2_rocm.models import MambaConfig, MambaLMHeadModel

    assert "mamba2_rocm" not in mamba_ssm.__file__, "run beside the real mamba_ssm"
    results = {"upstream": mamba_ssm.__file__, "device": torch.cuda.get_device_name()}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        up = Upstream(UpConfig(**COMMON, **cfg), device="cuda", dtype=torch.float32)
        ours = MambaLMHeadModel(MambaConfig(**COMMON, **cfg), device="cuda", dtype=torch.float32)
        ours.load_state_dict(up.state_dict(), strict=True)
        x = torch.randint(0, 1000, (2, 333), device="cuda")
        lu, gu = grads_of(up, x)
        lo, go = grads_of(ours, x)
        worst = max(
            (((go[n] - gu[n]).abs().max() / gu[n].abs().max().clamp_min(1e-12)).item(), n)
            for n in gu
        )
        prompt = 100
        out = ours.generate(x[:, :prompt], max_length=160, output_scores=True, cg=True,
                            return_dict_in_generate=True, teacher_outputs=x)  # fmt: skip
        scores = torch.stack(out.scores, 1)
        gen_err = (scores - lo[:, prompt - 1 : 159]).abs().max() / lo.abs().max()
        up_train = train(copy.deepcopy(up), args.steps, 1)
        our_train = train(copy.deepcopy(ours), args.steps, 1)
        results[name] = {
            "logits_rel": ((lo - lu).abs().max() / lu.abs().max()).item(),
            "worst_grad_rel": worst[0], "worst_grad_param": worst[1],
            "generate_cg_vs_forward_rel": gen_err.item(),
            "train_loss_upstream": up_train, "train_loss_ours": our_train,
        }  # fmt: skip
        r = results[name]
        print(f"{name}: logits rel {r['logits_rel']:.2e}, worst grad rel {worst[0]:.2e} "
              f"({worst[1]}), generate(cg) vs forward {r['generate_cg_vs_forward_rel']:.2e}, "
              f"train loss upstream {up_train[0]} -> {up_train[-1]}, "
              f"ours {our_train[0]} -> {our_train[-1]}", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
