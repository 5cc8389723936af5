"""Differentiable communication regions of tensor parallelism.

Each region is an autograd function whose docstring names its forward and its backward
collective; the lowercase wrapper is what layers call. All of them are identities when the group
has one rank (``group=None`` included), so the same model runs without a process group.

Two pairs are conjugate: copy/reduce (enter and leave a region where each rank holds a partial
sum) and scatter/gather (enter and leave a region where each rank holds a slice of the last dim).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import comm


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


def _single(group) -> bool:
    return comm.group_size(group) == 1


def copy_to_tp(x: torch.Tensor, group: Optional[comm.ProcessGroup]) -> torch.Tensor:
    """Enter a TP region with a replicated input: the backward sums input grads over TP."""
    return x if _single(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Optional[comm.ProcessGroup]) -> torch.Tensor:
    """Leave a TP region by summing the per-rank partial results."""
    return x if _single(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Concatenate the last-dim shards of every TP rank; ``sizes`` are the shard widths in rank order."""
    return x if _single(group) else _GatherFromTP.apply(x, group, None if sizes is None else tuple(sizes))


def scatter_to_tp(
    x: torch.Tensor, group: Optional[comm.ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Keep this rank's slice of the last dim (balanced split unless ``sizes`` is given)."""
    return x if _single(group) else _ScatterToTP.apply(x, group, None if sizes is None else tuple(sizes))
