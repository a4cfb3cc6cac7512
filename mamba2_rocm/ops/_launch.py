"""Launching a prepared kernel on torch's current stream of a tensor's device, cheaply."""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.params import DTYPE_CODES
from mamba2_rocm.runtime.device import device_multiprocessors

torch = require_torch()
from torch._subclasses.fake_tensor import is_fake  # noqa: E402  (after the torch check)

#: Tensor dtype -> the dtype part of a kernel's name (``m2r_..._bf16``).
KERNEL_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: Tensor dtype -> the M2R_DTYPE_* code of a run-time-typed parameter (weights, A, D, ...).
DTYPE_CODE = {dt: DTYPE_CODES[str(dt).removeprefix("torch.")] for dt in KERNEL_DTYPE}
#: Largest grid y/z dimension on every target.
GRID_YZ_MAX = 65535
#: Columns a block of the reduce launches that add partial rows (csrc/block_reduce.h:
#: kColumnSumCols, column_sum's columns a block).
COLUMN_SUM_COLS = 16


def _current_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


#: torch's current stream on a device as the raw handle the driver API takes (same value as
#: ``current_stream(i).cuda_stream``, without building a Stream object: ~40x cheaper).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream)


#: The current device's index (``torch.cuda.current_device()`` without its lazy-init check:
#: a launch has a GPU tensor in hand, so CUDA is initialized).
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def launch(launcher, x, params: tuple, grid: tuple[int, int, int], threads: int) -> None:
    """Launch on x's device and torch's current stream there; switch devices only if needed."""
    index = x.get_device()
    if current_device() == index:  # the common case: no guard object, no switch
        launcher(params, grid, (threads, 1, 1), raw_stream(index))
        return
    with torch.cuda.device(index):
        launcher(params, grid, (threads, 1, 1), raw_stream(index))


_STATE_ROWS_THREADS = 256  # csrc/state_rows.hip: kThreads


def checked_state_rows(kset, indices, num_states: int):
    """The state-row indices of a decode step as the kernels that do not check them read them:
    an int32 copy made on the device by ``m2r_state_rows`` (csrc/state_rows.hip), in which -1
    (padding) stays and every index that is out of the pool, or names a row another entry also
    names, is -2 (NaN out, state untouched). int64 indices are read as int64: never truncated
    to another row. No device sync; one small launch per call that passes indices."""
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


def layout(t) -> tuple | None:
    """What argument checks and a launch's static fields depend on for a tensor: its type,
    shape, strides, dtype and device (not its address, which changes every call)."""
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def remember(plans: dict, key, plan, size: int) -> None:
    """Store a validated argument layout's plan; a full cache starts over (a decode loop
    reuses a handful of layouts)."""
    if len(plans) >= size:
        plans.clear()
    plans[key] = plan


def resident_blocks(launcher, threads: int) -> int | None:
    """Blocks of ``threads`` threads of ``launcher``'s kernel a multiprocessor holds at once, by
    the runtime's occupancy calculator (``Launcher.resident_blocks``); None where it cannot
    tell, or where the launcher is a stand-in without one (the CPU tests)."""
    ask = getattr(launcher, "resident_blocks", None)
    return None if ask is None else ask(threads)


def sm_count(device) -> int:
    """Multiprocessors (CUs on ROCm) of ``device``, which launch heuristics size grids by; 0
    where it is no GPU (launches stood in for on the CPU in tests)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_multiprocessors(index)


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


def traced(*tensors) -> bool:
    """Whether this call is being traced (torch.compile, export): compiling, or any of
    ``tensors`` is a fake / functional tensor. An op's backward runs under AOTAutograd's
    tracing without ``torch.compiler.is_compiling()`` set, on fake tensors: it must call the
    registered backward op (whose fake gives the shapes), never launch a kernel."""
    return torch.compiler.is_compiling() or any(t is not None and is_fake(t) for t in tensors)


def use_registered_op(x, *tensors) -> bool:
    """Whether a public function calls its ``torch.library`` op rather than the plain
    implementation: always while compiling, and in eager mode when the kernel tier would run
    on inputs that need autograd (see :func:`needs_autograd`). Otherwise the direct call saves
    the dispatcher's host time."""
    return torch.compiler.is_compiling() or (
        needs_autograd(x, *tensors) and choose(x.device)[0] == "kernel"
    )


def save_inputs(ctx, inputs, output, extra=()) -> None:
    """An autograd ``setup_context`` that saves every input (tensors through
    ``save_for_backward``); :func:`saved_inputs` gives them back. ``extra``: intermediate
    tensors saved with them (so saved-tensor hooks, as activation checkpointing and offloading
    use, see them too); :func:`saved_inputs` gives them back with ``extra=True``."""
    tensor = torch.Tensor
    ctx.tensor_pos = [i for i, t in enumerate(inputs) if isinstance(t, tensor)]
    ctx.others = [None if isinstance(t, tensor) else t for t in inputs]
    ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_pos), *extra)


def save_inputs_kept(ctx, inputs, output, attr: str) -> None:
    """An autograd ``setup_context`` for ops whose eager training forward keeps intermediates on
    ``ctx.<attr>`` (a tensor, a tuple of tensors or None entries, or absent): the inputs and
    those, all through ``save_for_backward`` (:func:`save_inputs`), so saved-tensor hooks
    (activation checkpointing, offloading) see every reference and autograd frees them after
    the backward. ``ctx.<attr>`` is cleared; the registered op's autograd (which has no eager
    forward) saves the inputs alone. Use with ``functools.partial(..., attr=...)``."""
    kept = getattr(ctx, attr, None)
    setattr(ctx, attr, None)
    if kept is None:
        kept = ()
    elif isinstance(kept, torch.Tensor):
        kept = (kept,)
    save_inputs(ctx, inputs, output, extra=tuple(kept))


def saved_inputs(ctx, extra: bool = False):
    """The op's inputs as :func:`save_inputs` kept them, in argument order; with ``extra``,
    ``(inputs, extra tensors)``. Call it once per backward: ``ctx.saved_tensors`` is read once
    (activation checkpointing's hooks refuse to unpack a tensor twice)."""
    saved, n = ctx.saved_tensors, len(ctx.tensor_pos)
    inputs = list(ctx.others)
    for i, t in zip(ctx.tensor_pos, saved[:n], strict=True):
        inputs[i] = t
    return (inputs, tuple(saved[n:])) if extra else inputs


def recomputed_grads(ctx, inputs, reference, differentiable: tuple[int, ...], grads) -> tuple:
    """The backward of an op whose inputs :func:`save_inputs` kept (``inputs``, from
    :func:`saved_inputs`): recompute the forward through ``reference`` (the op's PyTorch tier,
    same arguments, same semantics) under autograd and differentiate that, for the inputs at
    the ``differentiable`` positions that ask for a gradient. Activation memory is the
    inputs' (as mamba_ssm's checkpointing)."""
    inputs = list(inputs)
    want = [i for i in differentiable if inputs[i] is not None and ctx.needs_input_grad[i]]
    result: list = [None] * len(inputs)
    if not want:
        return tuple(result)
    if all(g is None or g.numel() == 0 for g in grads):  # empty outputs: nothing flows back
        for i in want:  # (and the reference may refuse empty inputs)
            result[i] = torch.zeros_like(inputs[i])
        return tuple(result)
    with torch.enable_grad():
        for i in want:
            inputs[i] = inputs[i].detach().requires_grad_()
        outs = reference(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad and o.numel()]  # fmt: skip
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in want],
                                      [g for _, g in pairs], allow_unused=True)  # fmt: skip
            for i, g in zip(want, got, strict=True):
                result[i] = g
    return tuple(result)


def wants_grads(ctx, inputs, differentiable: tuple[int, ...]) -> bool:
    """Whether any present input at the ``differentiable`` positions asks for a gradient."""
    return any(ctx.needs_input_grad[i] and inputs[i] is not None for i in differentiable)


def placed_grads(ctx, inputs, differentiable: tuple[int, ...], grads) -> tuple:
    """An autograd formula's result: ``grads`` (one per ``differentiable`` position) at their
    inputs' positions where that input is present and asks for it, None elsewhere."""
    result: list = [None] * len(inputs)
    for i, g in zip(differentiable, grads, strict=True):
        if ctx.needs_input_grad[i] and inputs[i] is not None:
            result[i] = g
    return tuple(result)


def entry(impl, op, train, *tensors):
    """What a public function calls: its ``torch.library`` op where :func:`use_registered_op`
    says so, and there, in eager training, ``train`` (the :func:`register_training` entry,
    without the dispatcher's round trips); else the plain implementation ``impl``."""
    if not use_registered_op(*tensors):
        return impl
    if not torch.compiler.is_compiling() and needs_autograd(*tensors):
        return train
    return op


def register_training(op, impl, setup_context, backward, eager_forward=None):
    """Give the custom op ``op`` (implementation ``impl``) its autograd formula, and return
    the eager training entry: a ``torch.autograd.Function`` over ``impl`` with the same
    ``setup_context`` / ``backward``, which skips the dispatcher (a Python custom op's round
    trips cost more host time than the kernels at training shapes: a conv training step took
    ~1 ms of host time through two of them on the H100's host). ``op`` stays what
    ``torch.compile`` traces. ``eager_forward(ctx, *inputs)``, if given, replaces ``impl`` in
    the eager entry: ``impl``'s result, with intermediates kept on ``ctx`` for ``backward``
    (which must also work without them: the registered op's autograd has none)."""
    op.register_autograd(backward, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out = impl(*inputs) if eager_forward is None else eager_forward(ctx, *inputs)
            setup_context(ctx, inputs, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Eager.__name__ = Eager.__qualname__ = f"Train_{impl.__name__}"
    return Eager.apply


class _InferenceOnly(torch.autograd.Function):
    """Identity on ``out``; backward refuses, naming the op (for ops that update a state in
    place, which take no autograd formula: torch's own error would not say why)."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"mamba2-rocm's {ctx.name} is inference-only (a decode step that updates its state "
            "in place, as in mamba_ssm / causal-conv1d, which have no backward for it either); "
            "train with the sequence ops (mamba_chunk_scan_combined, causal_conv1d_fn)."
        )


def inference_only(name: str, out, *inputs):
    """``out`` as is, unless autograd is recording for one of ``inputs``: then ``out`` on a
    graph whose backward raises with ``name`` (instead of gradients that silently stop)."""
    if not needs_autograd(*inputs):
        return out
    return _InferenceOnly.apply(name, out, *(t for t in inputs if t is not None))
