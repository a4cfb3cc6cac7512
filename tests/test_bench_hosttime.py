"""The host-time split of a decode step (mamba2_rocm.bench.hosttime): wrappers on the named
ops' module attributes, bound before a model module imports them, timing each call, owned by
whoever defines the op, and gone again on uninstall."""

from __future__ import annotations

import inspect
import sys
import time
import types

import pytest

from mamba2_rocm.bench.hosttime import OpClock, owner_totals


@pytest.fixture
def fake_ops(monkeypatch):
    """A real-looking mamba_ssm op (owner mamba_ssm) and one of ours (owner mamba2-rocm)."""

    def theirs(state, x, dt, A, B, C, D=None):
        time.sleep(0.002)
        return "theirs"

    theirs.__module__ = "mamba_ssm.ops.triton.selective_state_update"

    def ours(x, conv_state, weight, bias=None, activation=None):
        return "ours"

    ours.__module__ = "mamba2_rocm.ops.conv1d"
    ssu = types.ModuleType("mamba_ssm.ops.triton.selective_state_update")
    ssu.selective_state_update = theirs
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_update = ours
    root = types.ModuleType("mamba_ssm")  # (re-exports the op, as mamba_ssm does)
    root.selective_state_update = theirs
    monkeypatch.setitem(sys.modules, "mamba_ssm", root)
    monkeypatch.setitem(sys.modules, ssu.__name__, ssu)
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv)
    ops = (("causal_conv1d", "causal_conv1d_update"), (ssu.__name__, "selective_state_update"),
           ("no_such_module", "x"), ("causal_conv1d", "no_such_attr"))  # fmt: skip
    return ssu, conv, theirs, ours, ops


def test_calls_are_timed_per_op_and_owner(fake_ops):
    ssu, conv, theirs, ours, ops = fake_ops
    clock = OpClock().install(ops)
    try:
        # what a model module binds now is the wrapper, with the op's signature
        bound = ssu.selective_state_update
        assert bound is not theirs and inspect.signature(bound) == inspect.signature(theirs)
        assert sys.modules["mamba_ssm"].selective_state_update is bound  # the root's name too
        assert set(clock.accounts) == {"causal_conv1d.causal_conv1d_update",
                                       f"{ssu.__name__}.selective_state_update"}  # fmt: skip

        def step(n):
            for _ in range(n):
                assert bound(1, 2, 3, 4, 5, 6) == "theirs"
                assert conv.causal_conv1d_update(1, 2, 3) == "ours"

        def prefill():
            conv.causal_conv1d_fn(0, 1, 2)

        conv.causal_conv1d_fn = ours  # (an op both runs call once: the prefill's)
        clock.install((("causal_conv1d", "causal_conv1d_fn"),))
        per = clock.per_token(lambda: (prefill(), step(5)), lambda: (prefill(), step(1)), 4)
        assert "causal_conv1d.causal_conv1d_fn" not in per
        mine = per["causal_conv1d.causal_conv1d_update"]
        peer = per[f"{ssu.__name__}.selective_state_update"]
        assert mine["owner"] == "mamba2-rocm" and peer["owner"] == "mamba_ssm"
        assert mine["calls_per_token"] == peer["calls_per_token"] == 1.0
        assert 1500 < peer["host_us_per_token"] < 20000 and mine["host_us_per_token"] < 500
        totals = owner_totals(per)
        assert set(totals) == {"mamba2-rocm", "mamba_ssm"} and totals["mamba_ssm"] > 1500
    finally:
        clock.uninstall()
    assert ssu.selective_state_update is theirs and conv.causal_conv1d_update is ours
    assert sys.modules["mamba_ssm"].selective_state_update is theirs


def test_an_op_that_raises_is_still_counted(fake_ops):
    _, conv, _, _, ops = fake_ops

    def broken(*a, **k):
        raise ValueError("bad input")

    conv.causal_conv1d_update = broken
    clock = OpClock().install(ops[:1])
    try:
        with pytest.raises(ValueError, match="bad input"):
            conv.causal_conv1d_update()
        assert clock.snapshot()["causal_conv1d.causal_conv1d_update"][0] == 1
        assert OpClock.install(clock, ops[:1]) is clock  # installing twice wraps once
        assert conv.causal_conv1d_update.__wrapped__ is broken
    finally:
        clock.uninstall()
    assert conv.causal_conv1d_update is broken


def test_transformers_binds_the_timed_ops(tmp_path):
    """The assumption the split rests on, with transformers itself (CPU, the drop-in's torch
    tier, a fresh process): installed before the model module is imported, the wrappers are
    what its Mamba2 decode calls, once per layer per token."""
    import json
    import subprocess

    code = """
import json, torch
import mamba2_rocm.dropin as d
d.activate()
from mamba2_rocm.bench.hosttime import OpClock
clock = OpClock().install()
import transformers
cfg = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16,
    state_size=16, n_groups=1, expand=2, conv_kernel=4, chunk_size=16, vocab_size=100)
model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 100, (1, 5))
gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
with torch.no_grad():
    print(json.dumps(clock.per_token(lambda: gen(5), lambda: gen(1), 4)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    per = json.loads(done.stdout.strip().splitlines()[-1])
    update = per["causal_conv1d.causal_conv1d_update"]
    assert update["owner"] == "mamba2-rocm" and update["calls_per_token"] == 3.0
    # transformers finds the decode step as mamba_ssm.selective_state_update (the package's
    # root) before the submodule: that binding is timed too
    step = per["mamba_ssm.ops.triton.selective_state_update.selective_state_update"]
    assert step["owner"] == "mamba2-rocm" and step["calls_per_token"] == 3.0
