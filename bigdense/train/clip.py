"""Gradient clipping by the norm the unsharded model would have."""
from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.sharding import shard_spec_of


def unique_params(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        candidates = model_or_params.parameters()
    elif isinstance(model_or_params, torch.Tensor):
        candidates = [model_or_params]
    else:
        candidates = model_or_params
    seen, out = set(), []
    for p in candidates:
        # Tied weights (an embedding shared with the head) are one tensor used twice: count it once.
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is this rank's shard of a larger tensor, as its layer declared it."""
    return shard_spec_of(param) is not None


def clip_grad_norm_(
    model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients in place by their global norm; return that norm (fp32, 0-dim).

    The norm is the one the unsharded model would have. Sharded parameters (those whose layer
    declared a shard spec, `shard_spec_of`) contribute their shard on every TP rank, summed over the TP group;
    TP-replicated parameters (a RowParallelLinear bias, LayerNorm weights) hold the same gradient on
    every TP rank and are counted once. Tied parameters are counted once. Norms accumulate in fp32
    whatever the gradients' dtype. ``norm_type`` is any p > 0 or ``inf`` (the largest magnitude).

    Collectives: one all-reduce of one scalar over ``tp_group`` (SUM for a p-norm, MAX for inf);
    ``tp_group`` defaults to the default context's. Nothing runs over DP: call this after DP
    gradient averaging (DDP's backward, or an explicit all-reduce), when every DP replica holds the
    same gradients and so computes the same norm and the same clip coefficient.

    ``max_norm <= 0`` only measures. A non-finite norm (an inf or nan in any gradient on any TP
    rank: replicated gradients enter the TP sum as ``0 * g`` on all but TP rank 0, which keeps an
    inf/nan non-finite) leaves the gradients untouched and is returned, so the caller can skip the
    step and report it; with ``error_if_nonfinite=True`` it raises instead. In the inf-norm a nan
    comes back as inf (MAX reductions may drop nans).
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    group = resolve_tp_group(tp_group)
    every = unique_params(model_or_params)
    params = [p for p in every if p.grad is not None]
    grads = [p.grad for p in params]
    # A rank without gradients still joins the all-reduce, on the device its collectives use.
    device = grads[0].device if grads else (every[0].device if every else torch.device("cpu"))
    total = _total_norm(params, grads, norm_type, group, device)

    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"clip_grad_norm_: the total {norm_type}-norm of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to get it back and skip the step instead"
        )
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


def _total_norm(params, grads, norm_type: float, group, device) -> torch.Tensor:
    """The global ``norm_type``-norm of ``grads`` (one all-reduce over ``group``), as documented in
    `clip_grad_norm_`: sharded gradients summed over TP, replicated ones counted on TP rank 0."""
    first_tp_rank = comm.group_rank(group) == 0
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float())
        # gloo/NCCL MAX may keep or drop a nan depending on operand order; inf survives either way.
        local = torch.nan_to_num(local, nan=math.inf, posinf=math.inf)
        return comm.all_reduce_(local, group, op=dist.ReduceOp.MAX)
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    for p, g in zip(params, grads):
        term = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).pow(norm_type)
        if is_tp_sharded(p):
            sharded = sharded + term
        else:
            replicated = replicated + term
    # 0 * inf = nan: a non-finite replicated gradient on any TP rank still poisons the sum.
    local = sharded + replicated * (1.0 if first_tp_rank else 0.0)
    return comm.all_reduce_(local, group).pow(1.0 / norm_type)
