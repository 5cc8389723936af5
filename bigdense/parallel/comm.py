"""Raw collectives over a tensor-parallel group, with no autograd.

Convention used throughout bigdense: ``group=None`` means *no parallelism* (a group of one rank,
no process group needed), never "the default world group". Every function here is then a cheap
no-op, which is what lets the same layer code run in a plain single process.

Uneven shards: gloo's ``all_gather`` refuses tensors of different sizes and NCCL's needs a list of
outputs, so `all_gather_dim` pads every shard to the largest one, uses the single-tensor
gather that both backends have (``all_gather_single``), and trims. One code path for both backends
means the CPU tests exercise exactly what runs on GPUs.

Inside ``torch.compile`` (`traceable`), the same functions issue PyTorch's functional collectives
(``torch.distributed._functional_collectives``), which dynamo and AOTAutograd trace into the graph
without a break; eager calls are unchanged.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ProcessGroup = dist.ProcessGroup

# torch 2.13 renamed the single-tensor all-gather (the old name warns); older releases lack the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_FUNCOL_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def traceable() -> bool:
    """Whether collectives must be the functional ones: we are being traced by torch.compile."""
    return torch.compiler.is_compiling()


def _gather_into(out: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup) -> None:
    """``out`` := every rank's ``tensor`` concatenated along dim 0."""
    if traceable():
        out.copy_(funcol.all_gather_tensor(tensor, 0, group))
    else:
        _all_gather_single(out, tensor, group=group)


def group_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    if group_size(group) > 1:
        if traceable():
            tensor.copy_(funcol.all_reduce(tensor, _FUNCOL_OPS[op], group))
        else:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_sizes(length: int, group: Optional[ProcessGroup], device) -> list[int]:
    """Every rank's ``length``, in rank order (one tiny collective)."""
    if group_size(group) == 1:
        return [int(length)]
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    _gather_into(out, mine, group)
    return [int(v) for v in out.tolist()]


def all_gather_dim(
    tensor: torch.Tensor,
    dim: int,
    group: Optional[ProcessGroup],
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``; shards may differ in length along ``dim``.

    ``sizes`` (each rank's length along ``dim``, in rank order) avoids a round of size exchange;
    when omitted it is gathered.
    """
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    if sizes is None:
        sizes = all_gather_sizes(tensor.shape[dim], group, tensor.device)
    sizes = [int(s) for s in sizes]
    rank = group_rank(group)
    if tensor.shape[dim] != sizes[rank]:
        raise RuntimeError(
            f"all_gather_dim: rank {rank} holds {tensor.shape[dim]} along dim {dim}, expected {sizes[rank]}"
        )
    longest = max(sizes)
    # The single-tensor all-gather concatenates along dim 0, so gather with `dim` moved to the front.
    front = tensor.movedim(dim, 0)
    if front.shape[0] < longest:
        pad = front.new_zeros((longest - front.shape[0],) + tuple(front.shape[1:]))
        front = torch.cat([front, pad], dim=0)
    front = front.contiguous()
    out = front.new_empty((world * longest,) + tuple(front.shape[1:]))
    _gather_into(out, front, group)
    if all(s == longest for s in sizes):
        full = out
    else:
        full = torch.cat([out[r * longest : r * longest + s] for r, s in enumerate(sizes)], dim=0)
    return full.movedim(0, dim).contiguous()


def split_dim(
    tensor: torch.Tensor,
    dim: int,
    group: Optional[ProcessGroup],
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``dim`` (balanced split unless ``sizes`` is given)."""
    world = group_size(group)
    if world == 1:
        return tensor
    from .sharding import shard_sizes

    dim = dim % tensor.dim()
    if sizes is None:
        sizes = shard_sizes(tensor.shape[dim], world)
    if sum(sizes) != tensor.shape[dim]:
        raise RuntimeError(f"split_dim: sizes {list(sizes)} do not add up to {tensor.shape[dim]} along dim {dim}")
    rank = group_rank(group)
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def broadcast_(tensor: torch.Tensor, src_group_rank: int, group: Optional[ProcessGroup]) -> torch.Tensor:
    """In-place broadcast from the rank with ``src_group_rank`` inside ``group``."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)
    return tensor
