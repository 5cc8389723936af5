"""The classifier head's modes: which ranks its classes are split over (the TP group, or the whole
TP x DP mesh), the targets it accepts, and what its fused loss is handed once the shard mode, the
class sampling and the margin have shaped the inputs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...host_checks import checks_enabled
from ...parallel import comm
from ...parallel.context import get_default_context, resolve_tp_group
from ...parallel.regions import gather_batch_from_dp
from .margin import target_offset, unit_rows
from .sampling import ScoredClasses, draw_sample_seed, sample_classes
from .fused_ce import RowBlocks
from .metrics import current_loss_factor

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


class DPBlocks:
    """The rows each DP rank's tokens take when a head gathers them (a world-sharded head's tokens, a
    sampled head's targets), decided without a host read once the ranks' counts are known.

    With checks on (`bd.set_checks`), every call exchanges the ranks' token counts (one tiny
    all-gather, read on the host) and the blocks are exact. With checks off nothing is read: every
    rank pads its tokens to ``capacity``, the largest count of any earlier exchange (the rows are
    ignored targets: no loss, no gradient), and only the first call of a head exchanges. A rank with
    more tokens than that raises, naming the head; the other ranks then fail at the collective's
    deadline. A training loop gets its capacity from its first, checked steps."""

    def __init__(self):
        self.capacity: Optional[int] = None

    def sizes(self, n: int, group, device, where: str) -> tuple[int, ...]:
        ranks = comm.group_size(group)
        if checks_enabled() or self.capacity is None:
            sizes = tuple(comm.all_gather_sizes(n, group, device))
            self.capacity = max(self.capacity or 0, *sizes)
            return sizes if checks_enabled() else (self.capacity,) * ranks
        if n > self.capacity:
            raise ValueError(
                f"{where}: {n} tokens on this rank, more than the {self.capacity} every DP rank pads to with "
                "bd.set_checks(False) (the most any rank had while checks were on, or at the first call); run "
                "the largest batch once with checks on"
            )
        return (self.capacity,) * ranks


def gather_from_dp(head, target: torch.Tensor, ignore_index: int, h: Optional[torch.Tensor] = None):
    """Every DP rank's targets (and tokens ``h``, whose gradient is reduce-scattered back), in rank
    order, and the `RowBlocks` that say which rows are this rank's (with checks off, rows of
    padding hold ``ignore_index``) and, under a `metrics.loss_factor`, every rank's factor."""
    groups, n = head.groups, target.shape[0]
    sizes = head._dp_blocks.sizes(n, groups.dp, target.device, head._where())
    rank = comm.group_rank(groups.dp)
    if sizes[rank] > n:
        pad = sizes[rank] - n
        target = torch.cat([target, target.new_full((pad,), ignore_index)])
        h = None if h is None else torch.cat([h, h.new_zeros(pad, h.shape[1])])
    target = comm.all_gather_dim(target, 0, groups.dp, sizes)
    h = None if h is None else gather_batch_from_dp(h, groups.dp, sizes)
    factor = current_loss_factor()  # every rank's, when the caller weighs the ranks' losses (token weighting)
    factors = None if factor is None or h is None else comm.all_gather_dim(
        factor.detach().float().reshape(1).to(target.device), 0, groups.dp, [1] * len(sizes))
    return h, target, RowBlocks(groups.dp, sizes, rank, n, factors)


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
    Nothing here reads the device on the host with checks off.
    """
    groups, rows = head.groups, None
    if groups.shard == "world":  # every rank scores every DP rank's tokens against its own classes
        h, target, rows = gather_from_dp(head, target, ignore_index, h)
    classes = ScoredClasses(head.weight, head.bias, target, head.class_start, head.num_classes, ignore_index,
                            max(head.partition_sizes))
    if head.sample_rate < 1.0:
        global_targets = target
        if rows is None and comm.group_size(groups.dp) > 1:
            global_targets = gather_from_dp(head, target, ignore_index)[1]
        classes = sample_classes(classes, draw_sample_seed(), head.sample_rate, global_targets, groups.classes)
    offset = None
    if head.margin is not None:
        h_unit, w_unit = unit_rows(h), unit_rows(classes.weight)
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
