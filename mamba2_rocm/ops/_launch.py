"""Launching a prepared kernel on torch's current stream of a tensor's device, cheaply."""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.params import DTYPE_CODES

torch = require_torch()

#: Tensor dtype -> the dtype part of a kernel's name (``m2r_..._bf16``).
KERNEL_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: Tensor dtype -> the M2R_DTYPE_* code of a run-time-typed parameter (weights, A, D, ...).
DTYPE_CODE = {dt: DTYPE_CODES[str(dt).removeprefix("torch.")] for dt in KERNEL_DTYPE}
#: Largest grid y/z dimension on every target.
GRID_YZ_MAX = 65535


def _current_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


#: torch's current stream on a device as the raw handle the driver API takes (same value as
#: ``current_stream(i).cuda_stream``, without building a Stream object: ~40x cheaper).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream)


def launch(launcher, x, params: tuple, grid: tuple[int, int, int], threads: int) -> None:
    """Launch on x's device and torch's current stream there; switch devices only if needed."""
    index = x.get_device()
    if torch.cuda.current_device() == index:  # the common case: no guard object, no switch
        launcher(params, grid, (threads, 1, 1), raw_stream(index))
        return
    with torch.cuda.device(index):
        launcher(params, grid, (threads, 1, 1), raw_stream(index))


_STATE_ROWS_THREADS = 256  # csrc/state_rows.hip: kThreads


def checked_state_rows(kset, indices, num_states: int):
    """The state-row indices of a decode step as the update kernels read them: an int32 copy
    made on the device by ``m2r_state_rows`` (csrc/state_rows.hip), in which -1 (padding) stays
    and every index that is out of the pool, or names a row another entry also names, is -2
    (NaN out, state untouched). int64 indices are read as int64: never truncated to another
    row. No device sync; one small launch per call that passes indices."""
    rows = torch.empty(indices.shape[0], dtype=torch.int32, device=indices.device)
    params = (
        indices.data_ptr(),
        rows.data_ptr(),
        indices.stride(0),
        indices.shape[0],
        num_states,
        int(indices.dtype == torch.int64),
        0,
    )  # fmt: skip  (StateRowsParams, field order)
    blocks = -(-indices.shape[0] // _STATE_ROWS_THREADS)
    launch(kset.launcher("m2r_state_rows"), indices, params, (blocks, 1, 1), _STATE_ROWS_THREADS)
    return rows


def ptr(t) -> int:
    """A tensor's address for a parameter struct; 0 (null) for an absent optional tensor."""
    return 0 if t is None else t.data_ptr()


def strides(t, n: int) -> tuple[int, ...]:
    """A tensor's strides for a parameter struct; n zeros for an absent optional tensor."""
    return (0,) * n if t is None else tuple(t.stride())


def as_kernel_float(t):
    """t itself when the kernels read its dtype, else a float32 copy (float64 parameters)."""
    return t if t is None or t.dtype in KERNEL_DTYPE else t.float()


def like(t, x):
    """t in x's dtype (a converted copy only when they differ): operands the kernels read in
    x's element type (B, C, z), which mamba_ssm callers may pass in float32."""
    return t if t is None or t.dtype == x.dtype else t.to(x.dtype)


def needs_autograd(*tensors) -> bool:
    """Whether an eager call must go through the registered op so that autograd records it: a
    kernel call made directly would return results cut off from the graph, and the gradients
    of its inputs would silently stay None."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def use_registered_op(x, *tensors) -> bool:
    """Whether a public function calls its ``torch.library`` op rather than the plain
    implementation: always while compiling, and in eager mode when the kernel tier would run
    on inputs that need autograd (see :func:`needs_autograd`). Otherwise the direct call saves
    the dispatcher's host time."""
    return torch.compiler.is_compiling() or (
        needs_autograd(x, *tensors) and choose(x.device)[0] == "kernel"
    )


def forward_only(op, public_name: str) -> None:
    """Give ``op`` an autograd formula that refuses backward with a message that says why,
    instead of torch's generic one (these kernels have no backward yet). Functional ops only:
    torch takes no formula for ops that mutate an argument, and raises its own error there."""

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"mamba2-rocm's {public_name} has no backward yet (its GPU kernels are forward-only). "
            "Run inference under torch.no_grad(), or set MAMBA2_ROCM_BACKEND=torch to train "
            "through the PyTorch implementation."
        )

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
