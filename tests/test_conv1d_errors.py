"""Every bad input to the conv1d ops raises a clear error naming the offending value."""

import pytest
import torch

from mamba2_rocm import causal_conv1d_fn, causal_conv1d_update
from mamba2_rocm.ops import conv1d as ops

X = torch.randn(2, 8, 16)
W = torch.randn(8, 4)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": X.double()}, TypeError, "x must be one of float32, float16, bfloat16, got float64"),
        ({"x": X.to(torch.int32)}, TypeError, "x must be one of .* got int32"),
        ({"x": X[0]}, ValueError, r"x must have 3 dimensions, got shape \(8, 16\)"),
        (
            {"x": X[:, :0], "weight": W[:0]},
            ValueError,
            r"x is empty \(shape \(2, 0, 16\)\); dim must",
        ),
        ({"x": [1, 2]}, TypeError, "x must be a torch.Tensor, got list"),
        ({"weight": torch.randn(8, 5)}, ValueError, r"width must be 2..4, got 5"),
        ({"weight": torch.randn(8, 1)}, ValueError, r"width must be 2..4, got 1"),
        (
            {"weight": torch.randn(7, 4)},
            ValueError,
            r"weight must have shape \(dim=8, width\), got \(7, 4\)",
        ),
        ({"weight": torch.randn(8, 4, 1)}, ValueError, "weight must have 2 dimensions"),
        ({"weight": torch.randn(8, 4).double()}, TypeError, "weight must be one of"),
        ({"bias": torch.randn(7)}, ValueError, r"bias must have shape \(8,\), got \(7,\)"),
        ({"bias": torch.randn(8).to(torch.int64)}, TypeError, "bias must be one of"),
        (
            {"activation": "relu"},
            ValueError,
            "activation must be None, 'silu' or 'swish', got 'relu'",
        ),
        (
            {"seq_idx": torch.zeros(2, 16, dtype=torch.int64)},
            TypeError,
            "seq_idx must be one of int32, got int64",
        ),
        (
            {"seq_idx": torch.zeros(2, 15, dtype=torch.int32)},
            ValueError,
            r"seq_idx must have shape \(2, 16\)",
        ),
        (
            {
                "seq_idx": torch.zeros(2, 16, dtype=torch.int32),
                "initial_states": torch.zeros(2, 8, 3),
            },
            ValueError,
            "not supported together with seq_idx",
        ),
        (
            {"seq_idx": torch.zeros(2, 16, dtype=torch.int32), "return_final_states": True},
            ValueError,
            "not supported together with seq_idx",
        ),
        (
            {"initial_states": torch.zeros(2, 8, 2)},
            ValueError,
            r"initial_states must have shape \(2, 8, 3\)",
        ),
        (
            {"initial_states": torch.zeros(2, 8, 3).half()},
            TypeError,
            "initial_states must be one of float32, got float16",
        ),
        (
            {"final_states_out": torch.zeros(2, 8, 3)},
            ValueError,
            "final_states_out was given but return_final_states is False",
        ),
        (
            {"final_states_out": torch.zeros(2, 8, 4), "return_final_states": True},
            ValueError,
            r"final_states_out must have shape \(2, 8, 3\)",
        ),
    ],
)
def test_fn_bad_inputs(kwargs, exc, match):
    args = {"x": X, "weight": W} | kwargs
    with pytest.raises(exc, match=match):
        causal_conv1d_fn(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices: CPU and a GPU")
def test_fn_wrong_device():
    with pytest.raises(ValueError, match="weight is on cuda:0, expected cpu"):
        causal_conv1d_fn(X, W.cuda())


def test_fn_wrong_device_meta():
    """A tensor on another device (meta stands in for a GPU here) is named in the error."""
    with pytest.raises(ValueError, match=r"bias is on meta, expected cpu \(the device of x\)"):
        causal_conv1d_fn(X, W, torch.empty(8, device="meta"))


XS = torch.randn(2, 8)
S = torch.randn(2, 8, 3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"x": torch.randn(2, 8, 1, 1)},
            ValueError,
            r"x must be \(batch, dim\) or \(batch, dim, seqlen\)",
        ),
        ({"x": torch.randn(2, 0, 1)}, ValueError, r"x is empty \(shape \(2, 0, 1\)\); dim must"),
        ({"conv_state": S.half()}, TypeError, "conv_state must be one of float32, got float16"),
        (
            {"conv_state": torch.randn(2, 7, 3)},
            ValueError,
            r"conv_state must have shape \(batch, dim=8, state_len\)",
        ),
        (
            {"conv_state": torch.randn(2, 8, 2)},
            ValueError,
            "state_len must be >= width - 1 = 3, got 2",
        ),
        (
            {"conv_state": torch.randn(5, 8, 3)},
            ValueError,
            "conv_state has 5 rows for a batch of 2; pass conv_state_indices",
        ),
        ({"weight": torch.randn(8, 6)}, ValueError, "width must be 2..4, got 6"),
        (
            {"cache_seqlens": torch.zeros(2, dtype=torch.int64)},
            TypeError,
            "cache_seqlens must be one of int32",
        ),
        (
            {"cache_seqlens": torch.zeros(3, dtype=torch.int32)},
            ValueError,
            r"cache_seqlens must have shape \(2,\)",
        ),
        (
            {"conv_state_indices": torch.zeros(3, dtype=torch.int32)},
            ValueError,
            r"conv_state_indices must have shape \(2,\)",
        ),
        (
            {"conv_state_indices": torch.zeros(2)},
            TypeError,
            "conv_state_indices must be one of int32, got float32",
        ),
        (
            {"activation": "gelu"},
            ValueError,
            "activation must be None, 'silu' or 'swish', got 'gelu'",
        ),
        (
            {"conv_state": S[:1].expand(2, 8, 3)},
            ValueError,
            "conv_state is written in place but its elements overlap",
        ),
        (
            {
                "conv_state": torch.randn(3, 8, 3),
                "conv_state_indices": torch.tensor([1, 1], dtype=torch.int32),
            },
            ValueError,
            r"conv_state_indices\[0\] and \[1\] are both 1",
        ),
    ],
)
def test_update_bad_inputs(kwargs, exc, match):
    args = {"x": XS, "conv_state": S, "weight": W} | kwargs
    before = args["conv_state"].clone()
    with pytest.raises(exc, match=match):
        causal_conv1d_update(**args)
    assert torch.equal(args["conv_state"], before), "a rejected call must not touch the state"


def test_update_out_of_range_pool_index_raises_on_cpu():
    state = torch.randn(3, 8, 3)
    with pytest.raises(
        IndexError, match=r"conv_state_indices\[1\] = 3 is out of range for a state pool of 3"
    ):
        causal_conv1d_update(
            XS, state, W, conv_state_indices=torch.tensor([0, 3], dtype=torch.int32)
        )


def test_bad_backend_env(monkeypatch):
    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", "cuda")
    with pytest.raises(
        ValueError, match="MAMBA2_ROCM_BACKEND='cuda' is not one of auto, kernel, torch, eager"
    ):
        causal_conv1d_fn(X, W)


def test_kernel_backend_on_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("MAMBA2_ROCM_BACKEND", "kernel")
    with pytest.raises(
        ValueError, match="MAMBA2_ROCM_BACKEND=kernel needs GPU tensors, got tensors on cpu"
    ):
        causal_conv1d_fn(X, W)


# ---- torch.library ---------------------------------------------------------------------------


def test_opcheck_fwd():
    x = torch.randn(2, 8, 33)
    for args in [
        (x, W, torch.randn(8), None, None, None, True),
        (x, W, None, None, torch.randn(2, 8, 3), torch.empty(2, 8, 3), False),
        (
            x.transpose(1, 2).contiguous().transpose(1, 2),
            W,
            None,
            torch.zeros(2, 33, dtype=torch.int32),
            None,
            None,
            False,
        ),
    ]:
        torch.library.opcheck(ops.causal_conv1d_fwd, args)


def test_opcheck_update():
    for args in [
        (torch.randn(2, 8, 1), torch.randn(2, 8, 3), W, None, True, None, None),
        (
            torch.randn(2, 8, 2),
            torch.randn(4, 8, 5),
            W,
            torch.randn(8),
            False,
            torch.tensor([1, 7], dtype=torch.int32),
            torch.tensor([3, -1], dtype=torch.int32),
        ),
    ]:
        torch.library.opcheck(ops.causal_conv1d_update_op, args)


def test_torch_compile_fullgraph():
    x = torch.randn(2, 8, 33)
    state = torch.randn(2, 8, 3)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, state):
        y = causal_conv1d_fn(x, W, activation="silu")
        return y, causal_conv1d_update(x[:, :, -1], state, W)

    ref_state = state.clone()
    y, upd = step(x, state)
    torch.testing.assert_close(y, causal_conv1d_fn(x, W, activation="silu"))
    torch.testing.assert_close(upd, causal_conv1d_update(x[:, :, -1], ref_state, W))
    torch.testing.assert_close(state, ref_state)  # the compiled in-place update happened


def test_import_without_torch_says_how_to_install(tmp_path):
    import subprocess
    import sys

    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    code = "import mamba2_rocm; print(mamba2_rocm.__version__); from mamba2_rocm import causal_conv1d_fn"
    env = {
        "PYTHONPATH": f"{tmp_path}:{ops.__file__.rsplit('/mamba2_rocm/', 1)[0]}",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "mamba2-rocm needs PyTorch" in proc.stderr
    assert "--index-url https://download.pytorch.org/whl/rocm" in proc.stderr


def test_opcheck_training_op():
    """The functional op training runs through (its backward: the causal_conv1d_bwd op), with
    inputs that ask for gradients: schema, fake tensor, autograd registration, AOT dispatch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 33, 8, generator=g).transpose(1, 2).requires_grad_()  # channel-last
    w = torch.randn(8, 4, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True)
    init = torch.randn(2, 8, 3, generator=g, requires_grad=True)
    for args in [
        (x, w, b, None, init, True, True),
        (x.detach().contiguous(), w, None, None, None, False, False),
    ]:
        torch.library.opcheck(ops.causal_conv1d_fwd_func, args)


def test_opcheck_backward_op():
    """The backward op alone (the torch tier's written-out formula on the CPU): schema, fake
    tensor, no aliasing between its outputs (absent gradients are empty tensors of their own)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 21, generator=g)
    w, b = torch.randn(8, 3, generator=g), torch.randn(8, generator=g)
    init, dfin = torch.randn(2, 8, 2, generator=g), torch.randn(2, 8, 2, generator=g)
    seq = torch.zeros(2, 21, dtype=torch.int32)
    seq[:, 9:] = 1
    dout = torch.randn(2, 8, 21, generator=g)
    for args in [
        (x, w, b, None, init, dout, dfin, True),
        (x.transpose(1, 2).contiguous().transpose(1, 2), w, None, seq, None, dout, None, False),
    ]:
        torch.library.opcheck(ops.causal_conv1d_bwd, args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(dout=torch.zeros(2, 8, 20)), r"dout must have shape \(2, 8, 21\)"),
        (dict(dout=torch.zeros(2, 8, 21, dtype=torch.float16)), "dout must be one of float32"),
        (dict(dfinal_states=torch.zeros(2, 8, 3)), r"dfinal_states must have shape \(2, 8, 2\)"),
        (dict(weight=torch.zeros(8, 5)), "width must be 2..4"),
    ],
)
def test_backward_op_bad_inputs(change, match):
    args = dict(x=torch.zeros(2, 8, 21), weight=torch.zeros(8, 3), bias=None, seq_idx=None,
                initial_states=None, dout=torch.zeros(2, 8, 21), dfinal_states=None, silu=False)  # fmt: skip
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.causal_conv1d_bwd(**args)
