"""Differentiable communication regions of tensor parallelism.

Each region is an autograd function whose docstring names its forward and its backward
collective; the lowercase wrapper is what layers call. All of them are identities when the group
has one rank (``group=None`` included), so the same model runs without a process group.

Two pairs are conjugate: copy/reduce (enter and leave a region where each rank holds a partial
sum) and scatter/gather (enter and leave a region where each rank holds a slice of the last dim).

Sequence parallelism adds the pairs along the sequence dimension (``SEQ_DIM``, the second-to-last
of ``(*, seq, hidden)``), where each rank holds its balanced share of the sequence between TP
regions: gather-from-sequence (all-gather forward, reduce-scatter backward) enters a region,
reduce-scatter-to-sequence (reduce-scatter forward, all-gather backward) leaves it. A module that
works per token on a replicated sequence can run on this rank's share alone: scatter-to-sequence
(split forward, all-gather backward) and gather-sequence-shares (all-gather forward, split
backward) around it. The column
projection fuses its entry with its matmul (`column_parallel_linear`) so that the gathered input
is never saved and its backward collectives overlap the weight-gradient GEMM.

One pair runs over data parallelism: gather_batch_from_dp (all-gather of the batch's rows, whose
backward reduce-scatters their gradients), for layers whose weights are split over DP as well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import comm, schedule
from .autocast import autocast_dtype, no_autocast
from .sharding import shard_sizes

SEQ_DIM = -2  # activations are (*, seq, hidden); sequence parallelism splits seq


class _CopyToTP(torch.autograd.Function):
    """forward: identity (input replicated on every TP rank); backward: all-reduce (sum) over TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum) of per-rank partial results over TP; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim (uneven shards allowed); backward: split, keep own slice."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        if sizes is None:  # the backward must split exactly as the shards came
            sizes = comm.all_gather_sizes(x.shape[-1], group, x.device)
        ctx.group, ctx.sizes = group, sizes
        return comm.all_gather_dim(x, -1, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.split_dim(grad, -1, ctx.group, ctx.sizes), None, None


class _ScatterToTP(torch.autograd.Function):
    """forward: split along the last dim, keep own slice; backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return comm.split_dim(x, -1, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_dim(grad, -1, ctx.group, ctx.sizes), None, None


class _GatherBatchFromDP(torch.autograd.Function):
    """forward: all-gather along dim 0 (every DP rank's rows of the batch, uneven allowed);
    backward: reduce-scatter (sum) along dim 0, each rank keeping the gradient of its own rows.

    For a layer whose parameters are split over the DP ranks too (a world-sharded classifier head):
    every rank scores every rank's tokens against its own classes, so each rank's gradient of the
    gathered batch is a partial sum, completed by the reduce-scatter.
    """

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return comm.all_gather_dim(x, 0, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter_dim(grad.contiguous(), 0, ctx.group, ctx.sizes), None, None


def _single(group) -> bool:
    return comm.group_size(group) == 1


def copy_to_tp(x: torch.Tensor, group: Optional[comm.ProcessGroup]) -> torch.Tensor:
    """Enter a TP region with a replicated input: the backward sums input grads over TP."""
    return x if _single(group) else schedule.tag(_CopyToTP.apply(x, group))


def reduce_from_tp(x: torch.Tensor, group: Optional[comm.ProcessGroup]) -> torch.Tensor:
    """Leave a TP region by summing the per-rank partial results."""
    return x if _single(group) else schedule.tag(_ReduceFromTP.apply(x, group))


def gather_from_tp(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Concatenate the last-dim shards of every TP rank; ``sizes`` are the shard widths in rank order."""
    if _single(group):
        return x
    return schedule.tag(_GatherFromTP.apply(x, group, None if sizes is None else tuple(sizes)))


def scatter_to_tp(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Keep this rank's slice of the last dim (balanced split unless ``sizes`` is given)."""
    if _single(group):
        return x
    return schedule.tag(_ScatterToTP.apply(x, group, None if sizes is None else tuple(sizes)))


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along the sequence dim (uneven shards allowed); backward: reduce-scatter (sum) along it."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return comm.all_gather_dim(x, SEQ_DIM, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter_dim(grad.contiguous(), SEQ_DIM, ctx.group, ctx.sizes), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter (sum) along the sequence dim, keep own share; backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes or _balanced(x, group)  # the backward then needs no exchange
        return comm.reduce_scatter_dim(x.contiguous(), SEQ_DIM, group, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_dim(grad.contiguous(), SEQ_DIM, ctx.group, ctx.sizes), None, None


class _ScatterToSequence(torch.autograd.Function):
    """forward: split along the sequence dim, keep own share; backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes or _balanced(x, group)
        return comm.split_dim(x, SEQ_DIM, group, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_dim(grad.contiguous(), SEQ_DIM, ctx.group, ctx.sizes), None, None


class _GatherSequenceShares(torch.autograd.Function):
    """forward: all-gather along the sequence dim (every rank's share, uneven allowed); backward:
    split, keep own share. The conjugate of `_ScatterToSequence`: for a module that works on this
    rank's share of a replicated sequence and hands the whole sequence back (the gradient that
    comes back is replicated, so nothing is summed)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return comm.all_gather_dim(x, SEQ_DIM, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return comm.split_dim(grad, SEQ_DIM, ctx.group, ctx.sizes), None, None


def _balanced(x: torch.Tensor, group) -> tuple[int, ...]:
    return tuple(shard_sizes(x.shape[SEQ_DIM], comm.group_size(group)))


def _sizes(sizes):
    return None if sizes is None else tuple(int(s) for s in sizes)


def gather_from_sequence(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """``(*, S_local, d)`` -> ``(*, S, d)``: every rank's share of the sequence, in rank order.
    ``sizes``: every rank's ``S_local`` (exchanged when omitted)."""
    return x if _single(group) else schedule.tag(_GatherFromSequence.apply(x, group, _sizes(sizes)))


def reduce_scatter_to_sequence(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """``(*, S, d)`` partial sums -> ``(*, S_local, d)``: this rank's share of the summed sequence
    (balanced split unless ``sizes`` is given)."""
    return x if _single(group) else schedule.tag(_ReduceScatterToSequence.apply(x, group, _sizes(sizes)))


def scatter_to_sequence(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """``(*, S, d)`` replicated -> ``(*, S_local, d)``: this rank's share of the sequence."""
    return x if _single(group) else schedule.tag(_ScatterToSequence.apply(x, group, _sizes(sizes)))


def gather_sequence_shares(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """``(*, S_local, d)`` -> ``(*, S, d)`` replicated, after `scatter_to_sequence`: every rank's
    share in rank order; the backward keeps this rank's share of the (replicated) gradient.
    ``sizes``: every rank's ``S_local`` (exchanged when omitted)."""
    if _single(group):
        return x
    if sizes is None:
        sizes = comm.all_gather_sizes(x.shape[SEQ_DIM], group, x.device)
    return schedule.tag(_GatherSequenceShares.apply(x, group, _sizes(sizes)))


@dataclass(frozen=True)
class ColumnComm:
    """How `column_parallel_linear` communicates. ``seq_sizes``: every rank's sequence share, in
    rank order (sequence parallelism on), or ``None`` (the input is replicated)."""

    group: Optional[comm.ProcessGroup]
    seq_sizes: Optional[tuple[int, ...]] = None
    overlap: bool = True


class _ColumnParallelLinear(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for each projection ``(W_i, b_i)`` of one input entering a TP region.

    forward: none (``x`` replicated), or with sequence parallelism an all-gather of ``x`` along the
    sequence dim. backward: an all-reduce (sum) of the input gradient, or with sequence parallelism
    a reduce-scatter along the sequence dim, plus an all-gather re-gathering ``x`` for the weight
    gradients. Only ``x`` as it came (this rank's share of the sequence) is saved, so saved
    activations shrink with TP. With ``overlap`` the collectives are issued asynchronously: the
    re-gather runs during the input-gradient GEMM, the input-gradient reduction during the
    weight-gradient GEMMs (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``); without,
    each is waited for at once. The arithmetic is the same either way.

    Under autocast the GEMMs run in autocast's dtype, as ``F.linear`` would, and the input is cast
    before it is gathered (half the bytes in bf16).
    """

    @staticmethod
    def forward(ctx, x, cfg: ColumnComm, *params):
        xc, outs = _column_outputs(x, cfg, params)
        ctx.cfg, ctx.x_dtype = cfg, x.dtype
        ctx.save_for_backward(xc, *params)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        cfg = ctx.cfg
        xc, *params = ctx.saved_tensors
        weights, biases = params[0::2], params[1::2]
        with no_autocast(xc.device.type):
            grads = [g.to(xc.dtype) for g in grads]
            if cfg.seq_sizes is not None:
                gathering = comm.all_gather_dim_start(xc, SEQ_DIM, cfg.group, cfg.seq_sizes)
                if not cfg.overlap:
                    gathering = comm.completed(gathering.wait())
            grad_x = reducing = None
            if ctx.needs_input_grad[0]:
                grad_x = sum(g @ w.to(xc.dtype) for g, w in zip(grads, weights))
            total = xc if cfg.seq_sizes is None else gathering.wait()
            if grad_x is not None:
                reducing = (
                    comm.all_reduce_start(grad_x, cfg.group) if cfg.seq_sizes is None
                    else comm.reduce_scatter_dim_start(grad_x, SEQ_DIM, cfg.group, cfg.seq_sizes)
                )
                if not cfg.overlap:
                    reducing = comm.completed(reducing.wait())
            flat_x = _rows(total)
            param_grads = []
            for i, (g, w, b) in enumerate(zip(grads, weights, biases)):
                flat_g = _rows(g)
                need_w, need_b = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
                param_grads.append((flat_g.t() @ flat_x).to(w.dtype) if need_w else None)
                param_grads.append(flat_g.sum(0).to(b.dtype) if need_b else None)
            if reducing is not None:
                grad_x = reducing.wait().to(ctx.x_dtype)
        return (grad_x, None, *param_grads)


def _column_outputs(x: torch.Tensor, cfg: ColumnComm, params) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`_ColumnParallelLinear`'s forward arithmetic: ``x`` in the GEMMs' dtype, and the outputs."""
    device_type = x.device.type
    dtype = autocast_dtype(device_type, x.dtype)
    xc = x.to(dtype)
    with no_autocast(device_type):
        total = xc if cfg.seq_sizes is None else comm.all_gather_dim(xc, SEQ_DIM, cfg.group, cfg.seq_sizes)
        outs = tuple(
            torch.nn.functional.linear(total, w.to(dtype), None if b is None else b.to(dtype))
            for w, b in zip(params[0::2], params[1::2])
        )
    return xc, outs


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``(*, n)`` as a matrix ``(prod(*), n)`` (``reshape(-1, n)`` is ambiguous when ``n == 0``)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def column_parallel_linear(
    x: torch.Tensor,
    projections: Sequence[tuple[torch.Tensor, Optional[torch.Tensor]]],
    cfg: ColumnComm,
) -> tuple[torch.Tensor, ...]:
    """``x W_i^T + b_i`` for each ``(W_i, b_i)`` in ``projections`` (this rank's output columns),
    with ``x`` entering the TP region once for all of them (see `_ColumnParallelLinear`).

    ``x``: ``(*, in)`` replicated, or ``(*, S_local, in)`` with ``cfg.seq_sizes``; outputs
    ``(*, out_i_local)``, or ``(*, S, out_i_local)``.
    """
    params = [t for pair in projections for t in pair]
    if _single(cfg.group) and cfg.seq_sizes is not None:
        cfg = ColumnComm(cfg.group, None, cfg.overlap)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))):
        # Nothing to differentiate (a frozen layer fed by frozen ones, as under low-rank adapters, or
        # no_grad): the arithmetic alone. torch.compile mis-binds an autograd Function's arguments
        # when none of its inputs requires a gradient (a graph split per call, measured).
        return schedule.tag(_column_outputs(x, cfg, params)[1])
    return schedule.tag(_ColumnParallelLinear.apply(x, cfg, *params))


def gather_batch_from_dp(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Concatenate every DP rank's rows (dim 0); the backward sums the gradients over DP and returns
    each rank its rows. ``sizes``: every rank's row count in rank order (gathered when omitted)."""
    if _single(group):
        return x
    if sizes is None:
        sizes = comm.all_gather_sizes(x.shape[0], group, x.device)
    return schedule.tag(_GatherBatchFromDP.apply(x, group, tuple(sizes)))
