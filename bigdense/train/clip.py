"""Gradient clipping by the norm the unsharded model would have."""
from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.sharding import is_dtensor, is_world_sharded, local_tensor, shard_spec_of


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


def _check_norm_type(norm_type) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:  # also catches nan
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
    return value


def grad_norm(
    model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    norm_type: float = 2.0,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The global gradient norm the unsharded model would have (fp32, 0-dim), without clipping.

    What `clip_grad_norm_` measures; see there. One all-reduce of one scalar over ``tp_group`` (and
    one over the world with world- or FSDP-sharded parameters; only that one when every parameter
    is), foreach kernels (a handful of launches
    whatever the number of parameters), no host sync.
    """
    norm_type = _check_norm_type(norm_type)
    group = resolve_tp_group(tp_group)
    every = unique_params(model_or_params)
    params = [p for p in every if p.grad is not None]
    # A rank without gradients still joins the all-reduce, on the device its collectives use.
    device = params[0].grad.device if params else (every[0].device if every else torch.device("cpu"))
    plain = [p for p in params if not is_dtensor(p)]
    sharded = [p.grad.detach() for p in plain if is_tp_sharded(p) and not is_world_sharded(p)]
    replicated = [p.grad.detach() for p in plain if not is_tp_sharded(p)]
    world = [p.grad.detach() for p in plain if is_world_sharded(p)]
    # Which parameters are world- or FSDP-sharded is the model's, the same on every rank: all join or none.
    world_group = _world() if any(is_world_sharded(p) or is_dtensor(p) for p in every) else None
    # Under FSDP every term may be in the world sum: then the TP all-reduce is skipped.
    tp_sum = group if any(not (is_world_sharded(p) or is_dtensor(p)) for p in every) else None
    # Replicated gradients are the same on every TP rank: counted on TP rank 0 only, but as 0 * g
    # elsewhere, so an inf/nan on any rank still poisons the total (0 * inf = nan).
    weight = 1.0 if comm.group_rank(group) == 0 else 0.0
    # FSDP-sharded gradients (DTensors over DP): each rank's slice of its TP-local tensor, summed over
    # the whole mesh with world-sharded ones; weighted as above over TP, and over HSDP's replicas.
    dp_sharded = [(local_tensor(p.grad.detach()), (1.0 if is_tp_sharded(p) else weight) * _first_replica(p.grad))
                  for p in params if is_dtensor(p)]
    if math.isinf(norm_type):
        local = torch.maximum(_foreach_max_abs(sharded, device), _foreach_max_abs(replicated, device) * weight)
        # gloo/NCCL MAX may keep or drop a nan depending on operand order; inf survives either way.
        local = torch.maximum(local, _foreach_max_abs(world, device))
        for w, grads in _by_weight(dp_sharded).items():
            local = torch.maximum(local, _foreach_max_abs(grads, device) * w)
        local = torch.nan_to_num(local, nan=math.inf, posinf=math.inf)
        return comm.all_reduce_(comm.all_reduce_(local, tp_sum, op=dist.ReduceOp.MAX), world_group,
                                op=dist.ReduceOp.MAX)
    local = _foreach_power_sum(sharded, norm_type, device) + _foreach_power_sum(replicated, norm_type, device) * weight
    total = comm.all_reduce_(local, tp_sum)
    if world_group is not None:  # every world or FSDP shard is different: summed over the whole mesh
        spread = _foreach_power_sum(world, norm_type, device)
        for w, grads in _by_weight(dp_sharded).items():
            spread = spread + _foreach_power_sum(grads, norm_type, device) * w
        total = total + comm.all_reduce_(spread, world_group)
    return total.pow(1.0 / norm_type)


def _first_replica(grad: torch.Tensor) -> float:
    """1.0 on the first replica of a DTensor's shard (coordinate 0 on each mesh dim it is replicated
    over: HSDP's replicate dim), else 0.0."""
    from torch.distributed.tensor import Replicate

    coordinate = grad.device_mesh.get_coordinate()
    replicas = [c for c, placement in zip(coordinate, grad.placements) if isinstance(placement, Replicate)]
    return 1.0 if all(c == 0 for c in replicas) else 0.0


def _by_weight(weighted: list) -> dict:
    out: dict = {}
    for grad, w in weighted:
        out.setdefault(w, []).append(grad)
    return out


def _world() -> Optional[dist.ProcessGroup]:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _foreach_power_sum(grads: list, norm_type: float, device) -> torch.Tensor:
    """sum_i ||g_i||_p^p in fp32 (foreach: one launch per dtype/device group, not per tensor)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
    return torch.stack([n.to(device) for n in norms]).pow(norm_type).sum()


def _foreach_max_abs(grads: list, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, math.inf, dtype=torch.float32)
    return torch.stack([n.to(device) for n in norms]).amax()


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
    every TP rank and are counted once. Parameters split over every rank (a world-sharded classifier
    head: shard spec ``group="world"``) have no DP replicas: their shards are summed over the whole
    mesh, so they too count once; so are the local slices of FSDP-sharded parameters (DTensor
    gradients, `bigdense.train.engines.fsdp`), a TP-replicated one counted on TP rank 0 and, under
    HSDP, on the first replica only. Tied parameters are counted once. Norms accumulate in fp32
    whatever the gradients' dtype. ``norm_type`` is any p > 0 or ``inf`` (the largest magnitude).
    ``max_norm`` must be a finite number > 0 (to measure without clipping, use `grad_norm`).

    Collectives: one all-reduce of one scalar over ``tp_group`` (SUM for a p-norm, MAX for inf);
    with world- or FSDP-sharded parameters one more over the world (only that one when every
    parameter is). ``tp_group`` defaults to the default
    context's. Apart from that nothing runs over DP: call this after DP
    gradient averaging (DDP's backward, or an explicit all-reduce), when every DP replica holds the
    same gradients and so computes the same norm and the same clip coefficient. Foreach kernels
    and no host sync: the coefficient is applied on the device.

    A non-finite norm (an inf or nan in any gradient on any TP rank) leaves the gradients
    untouched and is returned, so the caller can skip the step and report it; with
    ``error_if_nonfinite=True`` it raises instead (which reads the norm on the host). In the
    inf-norm a nan comes back as inf (MAX reductions may drop nans).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
        math.isfinite(max_norm) and max_norm > 0
    ):
        raise ValueError(
            f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r} "
            "(to measure the norm without clipping, use bd.grad_norm)"
        )
    total = grad_norm(model_or_params, norm_type, tp_group=tp_group)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"clip_grad_norm_: the total {float(norm_type)}-norm of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to get it back and skip the step instead"
        )
    grads = [local_tensor(p.grad) for p in unique_params(model_or_params) if p.grad is not None]
    if grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), group_grads in by_dtype.items():
            torch._foreach_mul_(group_grads, coef.to(device=device, dtype=dtype))
    return total

