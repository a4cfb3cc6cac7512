"""Tensor / sequence parallelism (``models.parallel``) on 2 CPU processes over gloo: the split
layers against their dense equivalents, forward and backward, with and without sequence
parallelism."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")  # fmt: skip
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sequence_parallel: bool, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        _check(rank, sequence_parallel)
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check(rank: int, seq: bool) -> None:
    from mamba2_rocm.models.parallel import (
        ColumnParallelLinear,
        ParallelEmbeddings,
        RowParallelLinear,
        all_gather,
    )

    group = dist.group.WORLD
    torch.manual_seed(0)  # the same dense weights and inputs on every rank
    d, hidden, rows = 12, 20, 6
    fc1, fc2 = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
    x = torch.randn(rows, d, requires_grad=True)
    want = fc2(torch.relu(fc1(x)))
    dout = torch.randn_like(want)
    want.backward(dout)

    col = ColumnParallelLinear(d, hidden, group, sequence_parallel=seq)
    row = RowParallelLinear(hidden, d, group, sequence_parallel=seq)
    half = hidden // WORLD
    with torch.no_grad():
        col.weight.copy_(fc1.weight[rank * half : (rank + 1) * half])
        col.bias.copy_(fc1.bias[rank * half : (rank + 1) * half])
        row.weight.copy_(fc2.weight[:, rank * half : (rank + 1) * half])
        if rank == 0:
            row.bias.copy_(fc2.bias)
    assert (row.bias is not None) == (rank == 0)  # the bias lives on the first rank only
    part = rows // WORLD
    xin = x.detach()[rank * part : (rank + 1) * part] if seq else x.detach()
    xin.requires_grad_()
    out = row(torch.relu(col(xin)))
    mine = dout[rank * part : (rank + 1) * part] if seq else dout
    torch.testing.assert_close(out, want.detach()[rank * part : (rank + 1) * part] if seq
                               else want.detach())  # fmt: skip
    out.backward(mine)
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad[rank * half : (rank + 1) * half])
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad[:, rank * half : (rank + 1) * half])
    want_dx = x.grad[rank * part : (rank + 1) * part] if seq else x.grad
    torch.testing.assert_close(xin.grad, want_dx)

    # embeddings: vocabulary split over ranks, summed (reduce-scattered) over the group
    torch.manual_seed(1)  # (the row layer drew a bias on rank 0 only)
    emb = torch.nn.Embedding(10, d)
    pemb = ParallelEmbeddings(d, 10, 0, group, sequence_parallel=seq)
    with torch.no_grad():
        pemb.word_embeddings.weight.copy_(emb.weight[rank * 5 : (rank + 1) * 5])
    ids = torch.randint(0, 10, (2, 3))
    got = pemb(ids, combine_batch_seqlen_dim=True)
    full = emb(ids).reshape(6, d)
    torch.testing.assert_close(got, full[rank * 3 : (rank + 1) * 3] if seq else full)
    gathered = all_gather(torch.full((1, 2), float(rank)), group)
    assert gathered[:, 0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_layers_match_dense(sequence_parallel):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sequence_parallel, errors))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
