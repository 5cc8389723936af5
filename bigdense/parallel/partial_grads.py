"""Gradients left partial over TP, and where they are summed.

A parameter replicated over TP but applied to this rank's share of something TP splits gets a
partial gradient on each TP rank: under sequence parallelism, a norm's weight and bias or a row
layer's bias (applied to this rank's share of the sequence); in a converted model, a per-head norm
that sees this rank's heads only (Qwen3's ``q_norm``). By default its layer sums it inside
``backward()`` (`with_partial_grad`, through `copy_to_tp`: one all-reduce per parameter per
backward), so afterwards every rank holds the full gradient.

A training engine that owns the whole step can do what Megatron-LM does instead: inside
`deferred_partial_grad_sums()` the layers leave these gradients partial (they accumulate over the
micro-batches, and DDP averages them over DP like any other), and after the last backward
`sum_partial_grads_` sums all of them over TP in one all-reduce of one flat buffer per dtype --
before clipping and the optimizer read them. A GPT block's six such all-reduces per micro-batch
become one per optimizer step for the whole model. Summing is linear, so the result is the eager
one up to the order of floating-point additions.

The switch is read when a layer's forward runs (also the recompute of activation checkpointing,
which runs inside the same step's backward); a layer names the parameters it leaves partial in
``bd_partial_grad_params()``, which `partial_grad_params` collects.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.distributed import ProcessGroup

from . import comm
from .regions import copy_to_tp
from .sharding import local_tensor

_deferring = False  # a module global, not thread-local: autograd runs recomputes on its own threads


def with_partial_grad(param: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """``param`` as used by a layer that applies it to this rank's share (of the sequence, of the
    heads): its gradient summed over TP in backward, or left partial inside
    `deferred_partial_grad_sums`."""
    if _deferring or comm.group_size(group) == 1:
        return param
    return copy_to_tp(param, group)


@contextlib.contextmanager
def deferred_partial_grad_sums() -> Iterator[None]:
    """Within the block (forward and backward), layers leave partial gradients for
    `sum_partial_grads_`."""
    global _deferring
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before


def partial_grad_params(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, Optional[ProcessGroup]]]:
    """``(parameter, TP group)`` for every trainable parameter the model's layers leave partial
    when deferring (each once, in module order)."""
    seen, out = set(), []
    for module in model.modules():
        for p in getattr(module, "bd_partial_grad_params", lambda: [])():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((p, module.tp_group))
    return out


def sum_partial_grads_(params: list[tuple[torch.nn.Parameter, Optional[ProcessGroup]]]) -> None:
    """Sum the gradients of ``params`` (`partial_grad_params`) over their TP groups in place: one
    all-reduce per group and dtype. A parameter without a gradient gets the sum as one (a rank
    whose sequence share was empty contributes zeros)."""
    buckets: dict = {}
    for p, group in params:
        if comm.group_size(group) > 1:
            buckets.setdefault((group, p.dtype), []).append(p)
    for (group, _), bucket in buckets.items():
        # FSDP-sharded gradients: the same DP slice on every TP peer (the parameter is replicated
        # over TP, so FSDP splits it alike), summed as local tensors.
        grads = [local_tensor(p.grad if p.grad is not None else torch.zeros_like(p)) for p in bucket]
        flat = comm.all_reduce_(torch.cat([g.reshape(-1) for g in grads]), group)
        for p, grad, summed in zip(bucket, grads, flat.split([g.numel() for g in grads])):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(summed.view_as(grad))
