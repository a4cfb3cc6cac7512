"""The linear layers of a decode step, on a few rows: ``y = x W^T + b`` as one streaming read
of the weight (csrc/linear.hip), where that beats the BLAS library; ``F.linear`` everywhere else.

A decode step multiplies each layer's weights by one row per sequence of the batch. That is a
read of the weight and little arithmetic, and the BLAS libraries' kernels for it leave
bandwidth unused at a decode step's shapes (numbers in :data:`MAX_ROWS`' comment; ``python -m
mamba2_rocm bench linear`` measures them on any GPU). The models of :mod:`mamba2_rocm.models`
call :func:`step_linear` for their decode projections.

:func:`decode_linear` has ``torch.nn.functional.linear``'s semantics; it *is* ``F.linear``
(with its errors) wherever the kernel does not take the call: off the kernel tier, while
traced (torch.compile, export), under autocast, when autograd records the call, and for
layouts the kernel does not read (more than :data:`MAX_ROWS` rows, float64, mixed dtypes, an
input width that is not a whole number of 16-byte vectors, unaligned or non-unit-stride rows,
a non-contiguous weight, empty operands). Results equal ``F.linear``'s up to the order of the
float32 sums (the kernel adds in a fixed order: bit-identical runs).
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import LINEAR_FORMS
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import KERNEL_DTYPE, launch, layout, remember, sm_count
from mamba2_rocm.ops.conv1d import causal_conv1d_update

torch = require_torch()
F = torch.nn.functional
Tensor = torch.Tensor
#: What the prefetch takes: plain tensors and parameters (every model weight is one), not the
#: other subclasses (a trace's fake or functional tensors)
_WEIGHT_TYPES = (Tensor, torch.nn.Parameter)
from torch.nn.modules import module as _nn_module  # noqa: E402  (after the torch check)

#: The most rows (a decode batch) the kernel takes, and its row tiers (kernels.LINEAR_FORMS).
#: H100, bf16, CUDA graphs, each weight read from memory (copies rotated past L2), BLAS time /
#: ours (2026-12-06): one row, mamba2-130m in_proj / out_proj 1.12x / 1.55x, 1.3b 1.07x / 1.32x,
#: 2.7b 1.07x / 1.23x, 1.3b's LM head 1.09x; two rows 1.11x / 1.50x, 0.95x / 1.25x,
#: 0.91x / 1.18x, 1.05x; three and four rows lose at every in_proj (0.8x at 1.3b) while the
#: kernel re-reads x for each row from the cache, so the BLAS library takes them.
MAX_ROWS = max(LINEAR_FORMS)
ROW_TIERS = tuple(sorted(LINEAR_FORMS))
THREADS = 256  # csrc/linear.hip: kThreads
GROUP_THREADS = (64, 128, 256)  # threads a feature group: whole 64-thread steps on every target
#: Threads a multiprocessor the grid should give before a feature gets more threads (a group
#: walks its weight rows alone; too few groups leave the memory system idle).
FILL_THREADS_PER_SM = 400
PLAN_CACHE_SIZE = 64


def row_tier(rows: int) -> int:
    """The smallest kernel row tier that holds ``rows``."""
    return next(t for t in ROW_TIERS if t >= rows)


def group_threads(out_features: int, features_per_group: int, sms: int) -> int:
    """Threads a feature group: the fewest that give every multiprocessor
    :data:`FILL_THREADS_PER_SM` threads, at most a block."""
    groups = -(-out_features // features_per_group)
    for tpg in GROUP_THREADS:
        if groups * tpg >= sms * FILL_THREADS_PER_SM:
            return tpg
    return GROUP_THREADS[-1]


def _kernel_layout(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple | None:
    """``(rows, x2d)`` when the kernel reads these operands as they are, else None."""
    if x.dtype not in KERNEL_DTYPE or weight.dtype != x.dtype:
        return None
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.device != x.device):
        return None
    if weight.dim() != 2 or x.dim() < 1 or weight.device != x.device:
        return None
    out_f, in_f = weight.shape
    if x.shape[-1] != in_f or (bias is not None and bias.shape[0] != out_f):
        return None
    per_vec = 16 // x.element_size()
    if in_f == 0 or out_f == 0 or in_f % per_vec or not weight.is_contiguous():
        return None
    rows = x.numel() // in_f
    if not 1 <= rows <= MAX_ROWS:
        return None
    try:
        x2 = x.view(rows, in_f)  # rows evenly strided, unit stride inside a row
    except RuntimeError:
        return None
    if x2.stride(1) != 1:
        return None
    if rows > 1 and x2.stride(0) % per_vec:
        return None
    if bias is not None and bias.stride(0) != 1:
        return None
    return rows, x2


class _Plan:
    __slots__ = (
        "blocks",
        "group_threads",
        "in_features",
        "name",
        "out_features",
        "rows",
        "x_row_stride",
    )  # fmt: skip

    def __init__(self, x: Tensor, weight: Tensor, rows: int, x2: Tensor) -> None:
        tier = row_tier(rows)
        per_group, unroll = LINEAR_FORMS[tier]
        self.name = f"m2r_linear_{KERNEL_DTYPE[x.dtype]}_m{tier}_r{per_group}_u{unroll}"
        self.out_features, self.in_features = weight.shape
        self.group_threads = group_threads(self.out_features, per_group, sm_count(x.device))
        groups = -(-self.out_features // per_group)
        self.blocks = -(-groups // (THREADS // self.group_threads))
        self.rows = rows
        self.x_row_stride = x2.stride(0) if rows > 1 else self.in_features


_PLANS: dict = {}


def _kernel_plan(x, weight, bias):
    """``(kernel set, plan)`` when the kernel takes ``F.linear(x, weight, bias)``, else None.

    Every check on the way to the launch is a cheap one (a decode step calls this three times a
    layer, host-bound when not in a graph): plain tensors only (fake / functional tensors of a
    trace are subclasses, so they take ``F.linear``), then the layout's cached plan."""
    if (
        type(x) is not Tensor
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad)))
        or torch.is_autocast_enabled(x.device.type)
    ):  # fmt: skip
        return None
    tier, kset = choose(x.device)
    if tier != "kernel":
        return None
    try:
        key = (layout(x), layout(weight), layout(bias))
    except AttributeError:  # not tensors: F.linear names the argument
        return None
    plan = _PLANS.get(key)
    if plan is None:
        found = _kernel_layout(x, weight, bias)
        plan = False if found is None else _Plan(x, weight, *found)
        remember(_PLANS, key, plan, PLAN_CACHE_SIZE)
    if (not plan or x.data_ptr() % 16 or weight.data_ptr() % 16
            or (bias is not None and bias.data_ptr() % 16)):  # fmt: skip
        return None
    return kset, plan


#: LinearParams' conv fields when there is no conv step
_NO_CONV = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def _launch(kset, plan, x, weight, bias, conv=_NO_CONV, suffix: str = "") -> Tensor:
    y = torch.empty((*x.shape[:-1], plan.out_features), dtype=x.dtype, device=x.device)
    ptrs, strides, ints = conv[:3], conv[3:7], conv[7:]
    params = (
        x.data_ptr(),
        weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        *ptrs,
        plan.x_row_stride,
        plan.out_features,
        *strides,
        plan.rows,
        plan.out_features,
        plan.in_features,
        plan.group_threads,
        *ints,
    )  # fmt: skip  (LinearParams, field order)
    launch(kset.launcher(plan.name + suffix), x, params, (plan.blocks, 1, 1), THREADS)
    return y


def decode_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; our kernel for a few rows on the kernel tier."""
    found = _kernel_plan(x, weight, bias)
    if found is None:
        return F.linear(x, weight, bias)
    return _launch(*found, x, weight, bias)


_SILU = {None: 0, "silu": 1, "swish": 1}


def _conv_static(x, plan, conv_state, conv_weight, conv_bias, start, channels, activation):
    """LinearParams' conv strides and sizes when the _conv kernel takes this conv step's
    layout, else None (checked once per layout: :func:`_conv_fields` caches it)."""
    if conv_state.dim() != 3 or conv_weight.dim() != 2 or x.dim() != 2:
        return None
    rows, c, length = conv_state.shape
    width = conv_weight.shape[1]
    if (rows != plan.rows or c != channels or conv_weight.shape[0] != channels
            or not 1 <= width <= 4 or not width - 1 <= length <= 4
            or not 0 <= start <= plan.out_features - channels or conv_weight.stride(1) != 1):  # fmt: skip
        return None
    for t in (conv_state, conv_weight, conv_bias):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            return None
    if conv_bias is not None and (conv_bias.shape != (channels,) or conv_bias.stride(0) != 1):
        return None
    return (*conv_state.stride(), conv_weight.stride(0),
            start, channels, width, length, _SILU[activation], 0)  # fmt: skip


_CONV_PLANS: dict = {}


def _conv_fields(x, plan, conv_state, conv_weight, conv_bias, start, channels, activation):
    """LinearParams' conv fields when the _conv kernel takes this conv step, else None."""
    if (type(conv_state) is not Tensor or type(conv_weight) is not Tensor
            or activation not in _SILU
            or (conv_state.requires_grad and torch.is_grad_enabled())):  # fmt: skip
        return None
    key = (plan.rows, plan.out_features, x.dim(), layout(conv_state), layout(conv_weight),
           layout(conv_bias), start, channels, activation)  # fmt: skip
    static = _CONV_PLANS.get(key)
    if static is None:
        static = _conv_static(x, plan, conv_state, conv_weight, conv_bias, start, channels,
                              activation) or False  # fmt: skip
        remember(_CONV_PLANS, key, static, PLAN_CACHE_SIZE)
    if not static:
        return None
    bias_ptr = 0 if conv_bias is None else conv_bias.data_ptr()
    return (conv_state.data_ptr(), conv_weight.data_ptr(), bias_ptr, *static)


def in_proj_conv_step(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, conv_weight: Tensor,
    conv_bias: Tensor | None, start: int, channels: int, activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """A Mamba2 decode step's input projection and conv in one: ``(y, xbc)`` with
    ``y = F.linear(x, weight, bias)`` (x: (batch, in)) and ``xbc = causal_conv1d_update(
    y[:, start:start + channels], conv_state, conv_weight, conv_bias, activation)``,
    ``conv_state`` (batch, channels, state_len) advanced in place.

    Where the kernel takes the call (one launch: :func:`decode_linear`'s cases, state_len and
    conv_width at most 4, every conv tensor of x's dtype and device) the conv's outputs are
    written over the projection's in ``y``'s conv columns and ``xbc`` is a view of them; use
    ``xbc`` for those columns, never ``y``. Elsewhere the two ops run one after the other."""
    found = _kernel_plan(x, weight, bias)
    if found is None:
        y = F.linear(x, weight, bias)
    else:
        conv = _conv_fields(x, found[1], conv_state, conv_weight, conv_bias, start, channels,
                            activation)  # fmt: skip
        if conv is not None:
            y = _launch(*found, x, weight, bias, conv, "_conv")
            return y, y[:, start : start + channels]
        y = _launch(*found, x, weight, bias)  # (the plan in hand: not looked up again)
    xbc = causal_conv1d_update(y[..., start:start + channels], conv_state, conv_weight, conv_bias,
                               activation)  # fmt: skip
    return y, xbc


def _hooked(module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)  # fmt: skip


def plain_linear(module) -> bool:
    """Whether ``module(x)`` is ``F.linear(x, module.weight, module.bias)``: a plain
    ``nn.Linear`` without forward hooks (not a tensor-parallel linear, a LoRA wrapper, a
    quantized layer, nor a hooked one, which must be called as they are)."""
    return type(module) is torch.nn.Linear and not _hooked(module)


def step_linear(module, x: Tensor) -> Tensor:
    """``module(x)`` for a decode step: :func:`decode_linear` where :func:`plain_linear`."""
    if plain_linear(module):
        return decode_linear(x, module.weight, module.bias)
    return module(x)


# ---- weight prefetch -------------------------------------------------------------------------

#: Whether :func:`prefetch_beside` launches anything (a switch for measuring it against none).
PREFETCH = True
#: The most rows of a product whose weight :func:`prefetch_beside` reads ahead: the streaming
#: kernel's (MAX_ROWS). Above it the BLAS library reads the weight at its own pace and the
#: prefetch only competes with the step's other traffic: 1.3b-like MambaLMHeadModel, bf16,
#: graph decode, µs a token (H100, 2026-12-07, on / off alternating in one process, medians of
#: 12): batch 16 2686 / 2656 (off 1.1% faster), batch 1 1639 / 1658 (on 1.2% faster).
PREFETCH_MAX_ROWS = MAX_ROWS
_SECTOR = 32  # csrc/linear.hip: kSectorBytes, m2r_linear_prefetch reads a word of each sector
#: blocks of the prefetch grid per multiprocessor: half the GPU, so the step's own small kernels
#: find room beside it
PREFETCH_BLOCKS_PER_SM = 0.5
#: bytes of a mixer's in_proj weight (its tail: the features its kernel reads last) that a
#: decode step's Block prefetches beside its add + norm: about what the memory bus moves in the
#: few microseconds the norm and the launch gaps around it take
IN_PROJ_PREFETCH_BYTES = 8 << 20
_SIDE_STREAMS: dict = {}
_SECTORS_FIELD = 15  # LinearParams' in_features, the prefetch's sector count


def _prefetch_params(weight: Tensor, start: int, nbytes: int | None) -> tuple | None:
    """LinearParams of m2r_linear_prefetch over weight's bytes [start, start + nbytes) (to the
    end when nbytes is None), or None when there is nothing to read: no whole sector, an
    unaligned or non-contiguous weight."""
    if type(weight) not in _WEIGHT_TYPES or not weight.is_contiguous():
        return None
    total = weight.numel() * weight.element_size()
    start = max(0, min(start, total)) // _SECTOR * _SECTOR
    end = total if nbytes is None else min(total, start + max(0, nbytes))
    sectors = (end - start) // _SECTOR
    base = weight.data_ptr() + start
    if sectors <= 0 or sectors >= 2**31 or base % _SECTOR:
        return None
    # (LinearParams, field order: rows 1 keeps the kernel's guarded store off)
    return (0, base, 0, 0, *_NO_CONV[:3], 0, 0, *_NO_CONV[3:7], 1, 0, sectors, 0, *_NO_CONV[7:])


def prefetch_beside(weight: Tensor, start: int = 0, nbytes: int | None = None, rows: int = 1):
    """While a CUDA / HIP graph is being captured on the kernel tier: fork a side stream from
    the current one, launch ``m2r_linear_prefetch`` over ``weight``'s bytes ``[start, start +
    nbytes)`` there, and return the side stream, which :func:`join_prefetch` must join back
    before the capture ends. The prefetch starts once the work queued so far is done and runs
    beside what is queued after it; it writes nothing, so results are unchanged.

    Returns None (nothing launched) outside a capture (an eager decode step is host-bound: a
    launch more would cost more than it saves), off the kernel tier, when traced, when the
    product reading the weight has more than PREFETCH_MAX_ROWS ``rows``, or when ``PREFETCH``
    is off."""
    if (not PREFETCH or rows > PREFETCH_MAX_ROWS or type(weight) not in _WEIGHT_TYPES
            or weight.device.type != "cuda" or torch.compiler.is_compiling()):  # fmt: skip
        return None
    side = _SIDE_STREAMS.get(weight.device)
    if side is None:  # made on an eager call (the warm-up before a capture), not inside one
        side = _SIDE_STREAMS[weight.device] = torch.cuda.Stream(weight.device)
    if not torch.cuda.is_current_stream_capturing():
        return None
    tier, kset = choose(weight.device)
    params = _prefetch_params(weight, start, nbytes) if tier == "kernel" else None
    if params is None:
        return None
    side.wait_stream(torch.cuda.current_stream(weight.device))
    blocks = max(1, int(sm_count(weight.device) * PREFETCH_BLOCKS_PER_SM))
    blocks = min(blocks, -(-params[_SECTORS_FIELD] // THREADS))  # no more than the sectors need
    with torch.cuda.stream(side):
        launch(kset.launcher("m2r_linear_prefetch"), weight, params, (blocks, 1, 1), THREADS)
    return side


def join_prefetch(side) -> None:
    """The current stream waits for a :func:`prefetch_beside` side stream (None: nothing)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def clear_plan_cache() -> None:
    """Forget every planned layout (tests; the cache never needs it for correctness)."""
    _PLANS.clear()
    _CONV_PLANS.clear()
