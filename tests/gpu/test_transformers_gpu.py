"""transformers end to end: tiny random-init Mamba2-family (and Mamba1) models resolve to our kernels through
the drop-in names and agree with transformers' own torch path (fp32), full forward and cached
decode. Each side runs in its own process (the names are resolved at model-module import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from tests.gpu.hf_models import MODELS, NEW_TOKENS, PROMPT  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: fp32 on both sides; the torch path and the kernels sum in different orders (chunked scan
#: vs. its own chunking, conv taps), so logits agree to ~1e-5 relative, well within this.
RTOL, ATOL = 1e-3, 1e-3
#: which kernel families each model must reach (causal_conv1d only for LFM2)
NEEDS = {name: ("m2r_conv1d", "m2r_ssd", "m2r_ssu") for name in MODELS}
NEEDS["lfm2"] = ("m2r_conv1d",)
NEEDS["mamba"] = NEEDS["falcon_mamba"] = ("m2r_conv1d", "m2r_selective_scan", "m2r_ssu")


def _side(name: str, weights: Path, out: Path, dropin: bool, fn: str = "run") -> dict:
    import torch

    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MAMBA2_ROCM_BACKEND="kernel", PYTHONPATH=path)
    env["MAMBA2_ROCM_DROPIN"] = "1" if dropin else "0"
    code = (
        "import sys, mamba2_rocm.dropin as d\n"
        f"{'d.activate()' if dropin else 'd.deactivate()'}\n"
        f"from tests.gpu.hf_models import {fn}\n"
        f"{fn}({name!r}, __import__('pathlib').Path({str(weights)!r}), "
        f"__import__('pathlib').Path({str(out)!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_torch_path(name, tmp_path):
    import torch

    weights = tmp_path / "weights.pt"
    torch_side = _side(name, weights, tmp_path / "torch.pt", dropin=False)
    ours = _side(name, weights, tmp_path / "ours.pt", dropin=True)
    # resolved to ours: the kernels ran; the torch side ran none of them
    assert torch_side["launched"] == []
    for family in NEEDS[name]:
        assert any(k.startswith(family) for k in ours["launched"]), (family, ours["launched"])
    # full forward
    torch.testing.assert_close(ours["logits"], torch_side["logits"], rtol=RTOL, atol=ATOL)
    # cached decode: the same greedy tokens, and each step's logits equal the full forward's
    # logits at that position (on our side: the decode kernels against the prefill kernels)
    assert ours["sequences"].shape == (PROMPT[0], PROMPT[1] + NEW_TOKENS)
    assert torch.equal(ours["sequences"], torch_side["sequences"])
    start = PROMPT[1] - 1
    at_steps = ours["full_logits"][:, start : start + NEW_TOKENS]
    torch.testing.assert_close(ours["step_logits"], at_steps, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours["step_logits"], torch_side["step_logits"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["mamba2"])
def test_training_matches_torch_path(name, tmp_path):
    """Training through the drop-in: transformers' Mamba2 mixer in training mode calls
    mamba_split_conv1d_scan_combined, whose backward runs our conv and norm backward kernels
    (and the scan's recomputation). One step from the same weights: the loss and every
    parameter's gradient agree with transformers' torch path (fp32); then 200 steps of a
    periodic-copy task bring the loss down as on the torch path."""
    weights = tmp_path / "weights.pt"
    torch_side = _side(name, weights, tmp_path / "torch.pt", dropin=False, fn="train")
    ours = _side(name, weights, tmp_path / "ours.pt", dropin=True, fn="train")
    assert torch_side["launched"] == []
    for family in ("m2r_conv1d_fwd", "m2r_conv1d_bwd", "m2r_ssd", "m2r_rmsnorm_bwd"):
        assert any(k.startswith(family) for k in ours["launched"]), (family, ours["launched"])
    assert abs(ours["loss"] - torch_side["loss"]) <= 1e-4 * abs(torch_side["loss"])
    assert ours["grads"].keys() == torch_side["grads"].keys()
    for n, g in torch_side["grads"].items():
        scale = g.abs().max().item() + 1e-8
        err = (ours["grads"][n] - g).abs().max().item()
        assert err <= 2e-3 * scale, f"{n}: max error {err:.3g} vs max |grad| {scale:.3g}"
    # the task is learned on both paths (from about log(vocab) = 4.6 nats)
    t_curve, o_curve = torch_side["curve"], ours["curve"]
    t_end, o_end = sum(t_curve[-10:]) / 10, sum(o_curve[-10:]) / 10
    assert t_end < 0.5 * t_curve[0] and o_end < 0.5 * o_curve[0], (t_curve[::20], o_curve[::20])
    assert o_end < 1.5 * t_end + 0.05, (t_end, o_end)
