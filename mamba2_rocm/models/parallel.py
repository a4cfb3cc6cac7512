"""Tensor and sequence parallelism for the models (mamba_ssm's ``distributed`` package):
collectives with their gradients, column / row parallel linear layers and parallel
embeddings, over ``torch.distributed`` (NCCL / RCCL on GPUs, gloo on CPUs).

Layout: with sequence parallelism the activations between blocks are split over the ranks
along their first dim (batch * seqlen); a column-parallel layer gathers them before its
product, a row-parallel layer reduce-scatters its partial sums back (all-reduces them without
sequence parallelism). Weights are split as upstream splits them, so each rank's
``state_dict`` is upstream's rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ColumnParallelEmbedding",
    "ColumnParallelLinear",
    "ParallelEmbeddings",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
    "parallel_linear_func",
    "reduce_scatter",
    "reduce_scatter_raw",
    "sync_shared_params",
]


# ---- collectives ---------------------------------------------------------------------------------


def all_gather_raw(x: Tensor, process_group, async_op: bool = False):
    """Every rank's x concatenated along dim 0: ``(out, work handle or None)``."""
    world = dist.get_world_size(process_group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = dist.all_gather_into_tensor(out, x.contiguous(), group=process_group,
                                         async_op=async_op)  # fmt: skip
    return out, handle


def reduce_scatter_raw(x: Tensor, process_group, async_op: bool = False):
    """The sum over ranks, this rank's 1/world slice of dim 0: ``(out, handle)``."""
    world = dist.get_world_size(process_group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter splits dim 0 ({x.shape[0]}) among {world} ranks")
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = dist.reduce_scatter_tensor(out, x.contiguous(), group=process_group,
                                        async_op=async_op)  # fmt: skip
    return out, handle


def all_reduce_raw(x: Tensor, process_group, async_op: bool = False):
    """The sum over ranks (in a contiguous copy of x, or x itself): ``(out, handle)``."""
    x = x.contiguous()
    return x, dist.all_reduce(x, group=process_group, async_op=async_op)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, process_group):
        ctx.process_group = process_group
        return all_gather_raw(x, process_group)[0]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_raw(grad, ctx.process_group)[0], None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, process_group):
        ctx.process_group = process_group
        return reduce_scatter_raw(x, process_group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_raw(grad, ctx.process_group)[0], None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, process_group):
        return all_reduce_raw(x, process_group)[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather(x: Tensor, process_group) -> Tensor:
    """Differentiable gather along dim 0 (its gradient: reduce-scatter)."""
    return _AllGather.apply(x, process_group)


def reduce_scatter(x: Tensor, process_group) -> Tensor:
    """Differentiable reduce-scatter along dim 0 (its gradient: all-gather)."""
    return _ReduceScatter.apply(x, process_group)


def all_reduce(x: Tensor, process_group) -> Tensor:
    """Differentiable sum over ranks (its gradient passes through: each rank holds the sum)."""
    return _AllReduce.apply(x, process_group)


def sync_shared_params(model: nn.Module, process_group) -> None:
    """Broadcast the parameters marked ``_shared_params`` from the group's first rank."""
    src = dist.get_global_rank(process_group, 0)
    for _, p in sorted((n, p) for n, p in model.named_parameters()
                       if getattr(p, "_shared_params", False)):  # fmt: skip
        with torch.no_grad():
            dist.broadcast(p, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: nn.Module, process_group) -> None:
    """Sum over ranks the gradients of parameters marked ``_sequence_parallel`` (those that
    see only this rank's slice of the sequence, such as norms between sequence-parallel
    layers)."""
    grads = [p.grad for _, p in sorted((n, p) for n, p in model.named_parameters()
                                       if getattr(p, "_sequence_parallel", False))]  # fmt: skip
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    with torch.no_grad():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=process_group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of ``dim`` split into units of ``multiple_of``; the first
    ``units % world_size`` ranks take one unit more."""
    units = dim // multiple_of
    return (units // world_size + int(local_rank < units % world_size)) * multiple_of


# ---- linear layers -----------------------------------------------------------------------------


class _ParallelLinear(torch.autograd.Function):
    """x (gathered over the group first with sequence parallelism) times weight; the input's
    gradient reduce-scattered (or all-reduced) back over the group."""

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, sequence_parallel):
        ctx.process_group, ctx.sequence_parallel = process_group, sequence_parallel
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        x = x.contiguous()
        total = x
        if process_group is not None and sequence_parallel:
            total = all_gather_raw(x, process_group)[0]
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, seq = ctx.process_group, ctx.sequence_parallel
        grad = grad.contiguous()
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight).reshape(*grad.shape[:-1], weight.shape[1])
            if group is not None:
                grad_x = (reduce_scatter_raw if seq else all_reduce_raw)(grad_x, group)[0]
        if ctx.needs_input_grad[1]:
            total = all_gather_raw(x, group)[0] if group is not None and seq else x
            grad_w = rows.t() @ total.reshape(-1, total.shape[-1])
        if ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b, None, None


def parallel_linear_func(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                         process_group=None, sequence_parallel: bool = True) -> Tensor:  # fmt: skip
    return _ParallelLinear.apply(x, weight, bias, process_group, sequence_parallel)


def _local_size(features: int, process_group, multiple_of: int, what: str) -> int:
    if features % multiple_of:
        raise ValueError(f"{what} ({features}) must be a multiple of {multiple_of}")
    return get_dim_for_local_rank(features, dist.get_world_size(process_group),
                                  dist.get_rank(process_group), multiple_of)  # fmt: skip


class ColumnParallelLinear(nn.Linear):
    """A linear layer whose output features are split over the ranks."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None,
                 dtype=None) -> None:  # fmt: skip
        local = _local_size(out_features, process_group, multiple_of, "out_features")
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group, self.sequence_parallel = process_group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return parallel_linear_func(x, self.weight, self.bias, self.process_group,
                                    self.sequence_parallel)  # fmt: skip


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks; the partial products
    summed over the group (reduce-scattered with sequence parallelism). The bias lives on
    the group's first rank only."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None,
                 dtype=None) -> None:  # fmt: skip
        local = _local_size(in_features, process_group, multiple_of, "in_features")
        rank0 = dist.get_rank(process_group) == 0
        super().__init__(local, out_features, bias=bias and rank0, device=device, dtype=dtype)
        self.process_group, self.sequence_parallel = process_group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        out = parallel_linear_func(x, self.weight, self.bias)
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)


# ---- embeddings --------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (the vocabulary) are split over the ranks; a rank returns zeros
    for tokens outside its slice (the sum over ranks is the full lookup)."""

    def __init__(self, num_embeddings: int, *args, process_group=None, padding_idx=None,
                 **kwargs) -> None:  # fmt: skip
        self.process_group = process_group
        world = 1 if process_group is None else dist.get_world_size(process_group)
        if num_embeddings % world:
            raise ValueError(f"num_embeddings ({num_embeddings}) must be divisible by the "
                             f"world size ({world})")  # fmt: skip
        if world > 1 and padding_idx is not None:
            raise ValueError("a vocabulary split over ranks does not take padding_idx")
        super().__init__(num_embeddings // world, *args, padding_idx=padding_idx, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        if self.process_group is None:
            return super().forward(input)
        start = dist.get_rank(self.process_group) * self.num_embeddings
        outside = (input < start) | (input >= start + self.num_embeddings)
        out = super().forward((input - start).masked_fill(outside, 0))
        return out.masked_fill(outside[..., None], 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """An embedding whose columns (the features) are split over the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, process_group=None,
                 **kwargs) -> None:  # fmt: skip
        self.process_group = process_group
        world = 1 if process_group is None else dist.get_world_size(process_group)
        if embedding_dim % world:
            raise ValueError(f"embedding_dim ({embedding_dim}) must be divisible by the world "
                             f"size ({world})")  # fmt: skip
        super().__init__(num_embeddings, embedding_dim // world, *args, **kwargs)


class ParallelEmbeddings(nn.Module):
    """Word embeddings split by vocabulary and (with ``max_position_embeddings`` > 0) position
    embeddings split by feature, summed over the group (reduce-scattered with sequence
    parallelism)."""

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int,
                 process_group, padding_idx=None, sequence_parallel: bool = True, device=None,
                 dtype=None) -> None:  # fmt: skip
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                      process_group=process_group, **factory)  # fmt: skip
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(
                max_position_embeddings, embed_dim, process_group=process_group, **factory
            )

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                combine_batch_seqlen_dim: bool = False) -> Tensor:  # fmt: skip
        _, seqlen = input_ids.shape
        world = dist.get_world_size(self.process_group)
        out = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            if position_ids is None:
                position_ids = torch.arange(seqlen, dtype=torch.long, device=input_ids.device)
            pos = self.position_embeddings(position_ids)
            if world <= 1:
                out = out + pos
            else:
                width = self.position_embeddings.embedding_dim
                rank = dist.get_rank(self.process_group)
                out[..., rank * width : (rank + 1) * width] += pos
        if combine_batch_seqlen_dim:
            out = out.reshape(-1, out.shape[-1])
        if world <= 1:
            return out
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)
