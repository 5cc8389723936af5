"""Which classes a sampled softmax scores (Partial FC), decided class by class, layout-free.

A class ``c`` is scored in a step when it is the target of some token of the *global* batch (every
data-parallel rank's tokens), or when ``keep_hash(seed, c) < rate * 2**32``: each other class is
kept with probability ``rate``, independently. The decision is a pure function of (seed, the global
batch's targets, the global class index), so a rank holding classes ``[start, stop)`` scores exactly
those classes of the set a single process would score, at any TP size, DP size or shard mode.

The hash is murmur3's 32-bit finaliser applied twice (to the class index mixed with the two halves of
the 63-bit seed), written in int64 tensor ops that never overflow, so it is exact and the same on
every device: a handful of vectorised kernels, however many classes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ...parallel import comm

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, a: int) -> torch.Tensor:
    """``(x * a) mod 2**32`` for ``x`` in [0, 2**32): split in 16-bit halves so no product reaches 2**63."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * a + (((hi * a) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keep_hash(seed: int, classes: torch.Tensor) -> torch.Tensor:
    """A uniform 32-bit value (int64 in [0, 2**32)) per class id, fixed by ``seed`` and the id alone."""
    k0, k1 = int(seed) & _MASK32, (int(seed) >> 32) & _MASK32
    c = classes.to(torch.int64)
    return _fmix32(_fmix32((c & _MASK32) ^ k0) ^ k1 ^ (c >> 32))


def check_sample_rate(rate, where: str) -> float:
    """``rate`` as a float in (0, 1], else a ValueError naming ``where``."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 < float(rate) <= 1.0):
        raise ValueError(f"{where}: sample_rate must be in (0, 1], got {rate!r}")
    return float(rate)


def keep_threshold(rate: float) -> int:
    """Hash values below this are kept: ``rate * 2**32`` rounded down (every class at rate 1)."""
    return min(int(float(rate) * 2**32), 2**32)


def sampled_class_mask(
    seed: int,
    global_targets: torch.Tensor,
    class_start: int,
    class_stop: int,
    rate: float,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Bool ``(class_stop - class_start,)``: which of the classes ``[class_start, class_stop)`` are scored.

    ``global_targets``: the targets of every token of the global batch (any shape; ``ignore_index``
    entries are skipped). A target is always scored; any other class with probability ``rate``.
    """
    device = global_targets.device
    classes = torch.arange(class_start, class_stop, dtype=torch.int64, device=device)
    mask = keep_hash(seed, classes) < keep_threshold(rate)
    t = global_targets.reshape(-1).to(torch.int64)
    local = t - class_start
    here = (t != ignore_index) & (local >= 0) & (local < class_stop - class_start)
    # Out-of-shard targets are sent to an index that is then dropped (no host-side filtering).
    mask_ext = torch.cat([mask, mask.new_zeros(1)])
    mask_ext.index_fill_(0, torch.where(here, local, class_stop - class_start), True)
    return mask_ext[:-1]


class ScoredClasses(NamedTuple):
    """What the fused loss scores on this rank: class rows, the targets in the numbering of the scored
    classes, where this rank's rows start in it, how many classes there are, the ignored label, and
    the most rows any rank scores (which sizes the chunks alike on every rank)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    target: torch.Tensor
    class_start: int
    num_classes: int
    ignore_index: int
    largest_shard: int


def sample_classes(full: ScoredClasses, seed: int, rate: float, global_targets: torch.Tensor, group) -> ScoredClasses:
    """Keep this rank's sampled class rows and renumber the targets over the sampled classes of all
    ranks of ``group`` (the ranks the classes are split over; one tiny all-gather of the counts).

    Sampled classes keep their order, so rank ``r``'s sampled rows are the global sampled classes
    ``[offset_r, offset_r + count_r)``. A target another rank holds is renumbered to some class
    outside this rank's range (which one does not matter to this rank); ignored targets become -1;
    labels outside ``[0, num_classes)`` become ``num_classes`` of the sampled set (still out of range).
    """
    c_local = full.weight.shape[0]
    stop = full.class_start + c_local
    mask = sampled_class_mask(seed, global_targets, full.class_start, stop, rate, full.ignore_index)
    index = mask.nonzero().squeeze(1)
    counts = comm.all_gather_sizes(index.numel(), group, full.weight.device)
    rank = comm.group_rank(group)
    offset, total = sum(counts[:rank]), sum(counts)
    t = full.target
    valid = t != full.ignore_index
    t_local = t - full.class_start
    here = valid & (t_local >= 0) & (t_local < c_local)
    position = (mask.cumsum(0) - 1)[t_local.clamp(0, max(c_local - 1, 0))] if c_local else torch.zeros_like(t)
    elsewhere = 0 if offset > 0 else counts[rank]
    in_range = (t >= 0) & (t < full.num_classes)
    target = torch.where(here, offset + position, torch.where(in_range, elsewhere, total))
    target = torch.where(valid, target, -1)
    bias = None if full.bias is None else full.bias.index_select(0, index)
    return ScoredClasses(full.weight.index_select(0, index), bias, target, offset, total, -1, max(counts))
