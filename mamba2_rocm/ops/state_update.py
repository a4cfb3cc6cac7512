"""``selective_state_update``: one decode step of the selective SSM, as in mamba_ssm.

Both forms: multi-head Mamba2 (state (b, h, p, n), x/dt/z (b, h, p), A (h, p, n), B/C (b, g, n),
D/dt_bias (h, p)) and Mamba1 without the head dim. The state is updated in place. The stride-0
"tied head dim" A/dt/dt_bias/D views that HF transformers passes go to the kernel as they are
(stride 0), never copied. Registered as ``torch.ops.mamba2_rocm.selective_state_update``.
"""

from __future__ import annotations

from mamba2_rocm._torch import require_torch
from mamba2_rocm.kernels import SSU_CONTIG_MAX_DSTATE
from mamba2_rocm.ops._backend import choose
from mamba2_rocm.ops._launch import (
    DTYPE_CODE,
    GRID_YZ_MAX,
    KERNEL_DTYPE,
    check_kernel_dtypes,
    launch,
    strides,
)
from mamba2_rocm.reference.ssd import selective_state_update_ref
from mamba2_rocm.reference.ssd_checks import check_state_update_args

torch = require_torch()
Tensor = torch.Tensor

__all__ = ["selective_state_update"]

_THREADS = 256  # csrc/state_update.hip: kThreads (one block per head and batch row)
_TIERS = (32, 64, 128, 256)  # kernels.SSU_DSTATE_TIERS
#: The per-(head, batch row) kernel needs this many blocks to fill a GPU; below it (small batch)
#: the one-row-per-group kernel spreads the work wider (measured: b1 3.4 vs 8.2 us on an H200).
HEAD_KERNEL_MIN_BLOCKS = 1024


def _kernel(kset, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices, dims, out) -> None:
    batch, nheads, headdim, dstate = dims.batch, dims.nheads, dims.headdim, dims.dstate
    tier = next(n for n in _TIERS if dstate <= n)
    if batch > GRID_YZ_MAX or nheads > GRID_YZ_MAX:
        raise ValueError(
            f"selective_state_update kernels take batch and nheads <= {GRID_YZ_MAX}, got {batch}, {nheads}"
        )
    p = (
        state.data_ptr(),
        x.data_ptr(),
        dt.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        0 if D is None else D.data_ptr(),
        0 if z is None else z.data_ptr(),
        0 if dt_bias is None else dt_bias.data_ptr(),
        out.data_ptr(),
        0 if indices is None else indices.data_ptr(),
        *state.stride(),
        *x.stride(),
        *dt.stride(),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *strides(D, 2),
        *strides(z, 3),
        *strides(dt_bias, 2),
        *out.stride(),
        batch,
        nheads,
        headdim,
        dstate,
        nheads // dims.ngroups,
        state.shape[0],
        int(dt_softplus),
        DTYPE_CODE[dt.dtype],
        DTYPE_CODE[A.dtype],
        DTYPE_CODE[D.dtype] if D is not None else 0,
        DTYPE_CODE[dt_bias.dtype] if dt_bias is not None else 0,
        0,
    )  # fmt: skip  (SsuParams, field order)
    per = max(1, tier // 32)  # elements per lane in the contiguous variant
    contig = (
        dstate == tier
        and tier <= SSU_CONTIG_MAX_DSTATE
        and batch * nheads >= HEAD_KERNEL_MIN_BLOCKS
        and state.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
        and (A.stride(-1) == 1 or (A.stride(-1) == 0 and A.stride(-2) == 0))  # unit, or tied per head
        and all(st % per == 0 for st in (*state.stride()[:-1], *B.stride()[:-1], *C.stride()[:-1]))
        and all(t.data_ptr() % (per * t.element_size()) == 0 for t in (state, B, C))
    )  # fmt: skip
    # contiguous: one block per (head, batch row); general: one block per 8 headdim rows
    grid = (nheads, batch, 1) if contig else (-(-headdim // (_THREADS // 32)), nheads, batch)
    launcher = kset.launcher(
        f"m2r_ssu_{KERNEL_DTYPE[state.dtype]}_{KERNEL_DTYPE[x.dtype]}_n{tier}{'_contig' if contig else ''}"
    )
    launch(launcher, x, p, grid, _THREADS)


def _as_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """The Mamba1 form as one head with headdim = dim: views only."""
    return (
        state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1),
        None if D is None else D.unsqueeze(0), None if z is None else z.unsqueeze(1),
        None if dt_bias is None else dt_bias.unsqueeze(0),
    )  # fmt: skip


def _impl(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool, state_batch_indices: Tensor | None,
) -> Tensor:  # fmt: skip
    dims = check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    tier, kset = choose(x.device)
    if tier != "kernel":
        cd = torch.float64 if tier == "eager" else torch.float32
        return selective_state_update_ref(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, cd
        )
    check_kernel_dtypes(
        x, {"state": state, "x": x, "dt": dt, "A": A, "D": D, "dt_bias": dt_bias},
        {"B": B, "C": C, "z": z},
    )  # fmt: skip
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dims.has_heads:
        _kernel(
            kset, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dims, out
        )
    else:
        # dims already describe the Mamba1 form as one head and one group
        args = _as_heads(state, x, dt, A, B, C, D, z, dt_bias)
        _kernel(kset, *args, dt_softplus, state_batch_indices, dims, out.unsqueeze(1))
    return out


selective_state_update_op = torch.library.custom_op(
    "mamba2_rocm::selective_state_update", _impl, mutates_args=("state",)
)


@selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def selective_state_update(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
    z: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """One decode step; ``state`` is updated in place; returns out with x's shape and dtype."""
    op = selective_state_update_op if torch.compiler.is_compiling() else _impl
    return op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices)
