"""Tiny random-init transformers models of the Mamba2 family (and Mamba1's), run in a subprocess so that the
drop-in names can be on (our kernels) or off (transformers' own torch path) per process.

``python -m tests.gpu.hf_models NAME WEIGHTS OUT``: builds NAME's tiny config, loads WEIGHTS
(or writes them, seeded, if absent), and saves to OUT: the logits of a full forward over a
prompt, greedy ``generate`` (cached decode) tokens and per-step logits, and the mamba2-rocm
kernels that ran (empty when transformers took its torch path).
"""

from __future__ import annotations

import sys
from pathlib import Path

#: name -> (config class, kwargs): 2 layers, hidden 128, a Mamba2 mixer of 8 heads x 32 with
#: state 16 (ngroups 2 where the config has groups), chunk 64 (< the prompt: several chunks).
MODELS = {
    "mamba2": ("Mamba2Config", dict(
        vocab_size=96, hidden_size=128, num_hidden_layers=2, num_heads=8, head_dim=32,
        state_size=16, n_groups=2, expand=2, conv_kernel=4, chunk_size=64,
    )),
    "bamba": ("BambaConfig", dict(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
    )),
    "falcon_h1": ("FalconH1Config", dict(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=256, mamba_n_heads=8,
        mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
    )),
    "zamba2": ("Zamba2Config", dict(
        vocab_size=96, hidden_size=128, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        mamba_d_state=16, mamba_ngroups=2, n_mamba_heads=8, num_attention_heads=4,
        chunk_size=64, intermediate_size=256,
    )),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=96, hidden_size=128, layers_block_type=["mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=32, n_groups=2, chunk_size=64,
    )),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=128,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=64,
    )),
    # Mamba1: intermediate 256, state 16, dt rank 8 (FalconMamba adds the B / C / dt RMSNorms)
    "mamba": ("MambaConfig", dict(
        vocab_size=96, hidden_size=128, num_hidden_layers=2, state_size=16, expand=2,
        conv_kernel=4, time_step_rank=8,
    )),
    "falcon_mamba": ("FalconMambaConfig", dict(
        vocab_size=96, hidden_size=128, num_hidden_layers=2, state_size=16, expand=2,
        conv_kernel=4, time_step_rank=8,
    )),
    "lfm2": ("Lfm2Config", dict(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )),
}  # fmt: skip
PROMPT = (2, 77)  # batch, tokens: odd, more than one chunk
NEW_TOKENS = 6


def _model(name: str, weights: Path, overrides: dict):
    """NAME's tiny config (with ``overrides``) and its fp32 model on the GPU, with the weights
    in WEIGHTS (written there, seeded, if absent)."""
    import torch
    import transformers

    cls_name, kwargs = MODELS[name]
    config = getattr(transformers, cls_name)(**(kwargs | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    else:
        torch.save(model.state_dict(), weights)
    return config, model.cuda()


def _launched() -> list[str]:
    """The mamba2-rocm kernels this process ran (empty on transformers' torch path)."""
    if "mamba2_rocm.runtime.loader" not in sys.modules:
        return []
    from mamba2_rocm.runtime.loader import kernels_for_device

    kset = kernels_for_device(0)
    return sorted(kset._launchers) if kset is not None else []


def run(name: str, weights: Path, out: Path) -> None:
    import torch
    import transformers

    config, model = _model(name, weights, {})
    model = model.eval()
    ids = torch.randint(3, config.vocab_size, PROMPT, generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        full = model(gen.sequences).logits  # the whole generated sequence in one forward
    launched = _launched()
    torch.save(
        {
            "logits": logits.cpu(),
            "sequences": gen.sequences.cpu(),
            "step_logits": torch.stack(gen.logits, 1).cpu(),
            "full_logits": full.cpu(),
            "launched": launched,
            "transformers": transformers.__version__,
        },
        out,
    )


#: the training check: a periodic-copy task (a random pattern of PERIOD tokens repeated to
#: TRAIN_LEN; the loss on every token after the first period, which the model can learn to
#: copy from PERIOD back), batch TRAIN_BATCH, Adam at 3e-3 for TRAIN_STEPS steps from the
#: shared weights
TRAIN_STEPS, PERIOD, TRAIN_LEN, TRAIN_BATCH = 200, 5, 80, 16
#: config changes for the training check. transformers' Mamba2 torch path normalizes the gated
#: norm over the whole d_inner, while in training mode its kernel path calls
#: mamba_split_conv1d_scan_combined, which (as mamba_ssm's) normalizes in ngroups groups: with
#: n_groups > 1 the two paths of transformers itself compute different models (measured: loss
#: 5.288 vs 5.261 at n_groups 2), so the comparison takes one group.
TRAIN_OVERRIDES = {"mamba2": {"n_groups": 1}}


def _task_batch(gen, vocab: int):
    import torch

    pattern = torch.randint(3, vocab, (TRAIN_BATCH, PERIOD), generator=gen)
    ids = pattern.repeat(1, -(-TRAIN_LEN // PERIOD))[:, :TRAIN_LEN]
    labels = ids.clone()
    labels[:, :PERIOD] = -100  # the first period cannot be predicted
    return ids.cuda(), labels.cuda()


def train(name: str, weights: Path, out: Path) -> None:
    """One training step (loss and every parameter's gradient, fp32) from the shared weights,
    then TRAIN_STEPS steps of the periodic-copy task (the loss curve), saved to OUT."""
    import torch

    config, model = _model(name, weights, TRAIN_OVERRIDES.get(name, {}))
    model = model.train()
    gen = torch.Generator().manual_seed(2)
    ids, labels = _task_batch(gen, config.vocab_size)
    loss = model(ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
             if p.grad is not None}  # fmt: skip
    first = loss.item()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    curve = []
    for _ in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        ids, labels = _task_batch(gen, config.vocab_size)
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        curve.append(loss.item())
    launched = _launched()
    torch.save({"loss": first, "grads": grads, "curve": curve, "launched": launched}, out)


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
