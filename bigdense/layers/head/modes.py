"""The classifier head's modes: which ranks its classes are split over (the TP group, or the whole
TP x DP mesh), the targets it accepts, and what its fused loss is handed once the shard mode, the
class sampling and the margin have shaped the inputs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...host_checks import checks_enabled
from ...parallel import comm
from ...parallel.context import get_default_context, resolve_tp_group
from ...parallel.random import draw_seed
from ...parallel.regions import gather_batch_from_dp
from .margin import target_offset
from .sampling import ScoredClasses, sample_classes
from .fused_ce import RowBlocks

SHARD_MODES = ("tp", "world")


@dataclass(frozen=True)
class ClassGroups:
    """``classes``: the group the classes are split over; ``tp``: the ranks that share one batch
    (inputs replicated); ``dp``: the data-parallel group (``None``: one rank)."""

    shard: str  # "tp" or "world" (the mode in effect: "world" falls back to "tp" without DP)
    classes: Optional[comm.ProcessGroup]
    tp: Optional[comm.ProcessGroup]
    dp: Optional[comm.ProcessGroup]


def resolve_class_groups(shard: str, tp_group, dp_group, where: str) -> ClassGroups:
    """The groups of a head built with ``shard=``; ``tp_group``/``dp_group`` default to the default
    context's. ``"world"`` needs the mesh's global rank order (``dp_rank * tp + tp_rank``), so that the
    shard index of a rank is its world rank and checkpoints can place every shard."""
    if shard not in SHARD_MODES:
        raise ValueError(f"{where}: shard must be one of {list(SHARD_MODES)}, got {shard!r}")
    tp = resolve_tp_group(tp_group)
    dp = dp_group if dp_group is not None else get_default_context().dp_group
    if shard == "tp" or comm.group_size(dp) == 1:
        if shard == "world":
            warnings.warn(f"{where}: shard='world' without a data-parallel group of more than one rank runs as "
                          "shard='tp'", stacklevel=3)
        return ClassGroups("tp", tp, tp, dp)
    tp_size, dp_size = comm.group_size(tp), comm.group_size(dp)
    expected = comm.group_rank(dp) * tp_size + comm.group_rank(tp)
    if dist.get_world_size() != tp_size * dp_size or dist.get_rank() != expected:
        raise ValueError(
            f"{where}: shard='world' splits the classes over the whole TP x DP mesh, which must be the world "
            f"with rank = dp_rank * tp + tp_rank (as bd.init_parallel builds it); got world size "
            f"{dist.get_world_size()}, rank {dist.get_rank()}, tp={tp_size}, dp={dp_size}"
        )
    return ClassGroups("world", dist.group.WORLD, tp, dp)


@dataclass
class LossInputs:
    """What `FusedVocabParallelCE` gets: tokens ``h`` (N, D), the scored ``classes`` of this rank,
    the margin's ``target_offset`` (N,) or None, and the DP ``rows`` of a world-sharded head."""

    h: torch.Tensor
    classes: ScoredClasses
    target_offset: Optional[torch.Tensor]
    rows: Optional[RowBlocks]


def loss_inputs(head, h: torch.Tensor, target: torch.Tensor, ignore_index: int) -> LossInputs:
    """The loss inputs of ``head`` (a ParallelClassifierHead) for flat ``h`` (N, D) and ``target`` (N,).

    In order: a world-sharded head gathers every DP rank's tokens (their gradients are
    reduce-scattered back); sampling keeps the scored class rows and renumbers the targets; a
    margin normalises both sides, scales the tokens and computes what it adds to the target logits.
    """
    groups, rows = head.groups, None
    if groups.shard == "world":  # every rank scores every DP rank's tokens against its own classes
        sizes = tuple(comm.all_gather_sizes(target.shape[0], groups.dp, h.device))
        h = gather_batch_from_dp(h, groups.dp, sizes)
        target = comm.all_gather_dim(target, 0, groups.dp, sizes)
        rows = RowBlocks(groups.dp, sizes, comm.group_rank(groups.dp))
    classes = ScoredClasses(head.weight, head.bias, target, head.class_start, head.num_classes, ignore_index,
                            max(head.partition_sizes))
    if head.sample_rate < 1.0:
        global_targets = target if rows is not None else comm.all_gather_dim(target, 0, groups.dp)
        classes = sample_classes(classes, draw_seed(), head.sample_rate, global_targets, groups.classes)
    offset = None
    if head.margin is not None:
        h_unit, w_unit = F.normalize(h, dim=-1), F.normalize(classes.weight, dim=-1)
        offset = target_offset(
            head.margin, h_unit, w_unit, classes.target, classes.class_start, classes.ignore_index,
            # (under sequence parallelism h's gradient stays partial: the sequence gather sums it)
            groups.classes, None if head.sequence_parallel else groups.tp,
            1.0 if rows is None else 1.0 / len(rows.sizes),
        )
        h, classes = h_unit * head.margin.scale, classes._replace(weight=w_unit)
    return LossInputs(h, classes, offset, rows)


def check_target(where: str, h: torch.Tensor, target, ignore_index: int, num_classes: int) -> None:
    """``target`` holds integer class ids shaped like ``h``'s leading dims, on ``h``'s device; with
    `bd.set_checks` on, each in ``[0, num_classes)`` or ``ignore_index`` (with checks off the loss
    marks bad labels on the device instead). Errors name ``where`` (the layer)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{where}: target must be a tensor of class ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"{where}: target must hold integer class ids, got dtype {target.dtype} "
            f"(class-probability targets are not supported)"
        )
    if tuple(target.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"{where}: target shape {tuple(target.shape)} must equal the input's leading dims "
            f"{tuple(h.shape[:-1])} (input {tuple(h.shape)})"
        )
    if target.device != h.device:
        raise ValueError(f"{where}: target is on {target.device}, the input on {h.device}")
    if not checks_enabled():
        return
    # target is replicated on TP, so every rank raises the same error with no collective.
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        values = target[bad]
        raise ValueError(
            f"{where}: label {int(values[0])} is outside [0, {num_classes}) "
            f"({values.numel()} bad label(s); ignore_index={ignore_index})"
        )
