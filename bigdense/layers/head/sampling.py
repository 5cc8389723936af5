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

import math
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


def keep_hash(seed, classes: torch.Tensor) -> torch.Tensor:
    """A uniform 32-bit value (int64 in [0, 2**32)) per class id, fixed by ``seed`` and the id alone.

    ``seed``: a Python int or an int64 tensor of one element (`draw_sample_seed`: never read on the
    host); the same value gives the same hash either way."""
    if isinstance(seed, torch.Tensor):
        seed = seed.to(classes.device, non_blocking=True).reshape(())
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c = classes.to(torch.int64)
    return _fmix32(_fmix32((c & _MASK32) ^ k0) ^ k1 ^ (c >> 32))


def draw_sample_seed() -> torch.Tensor:
    """The seed of one call's sample: the value `bigdense.parallel.random.draw_seed` would return,
    drawn from torch's default CPU generator the same way, but left in a tensor (no host read)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu")


def check_sample_rate(rate, where: str) -> float:
    """``rate`` as a float in (0, 1], else a ValueError naming ``where``."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 < float(rate) <= 1.0):
        raise ValueError(f"{where}: sample_rate must be in (0, 1], got {rate!r}")
    return float(rate)


def keep_threshold(rate: float) -> int:
    """Hash values below this are kept: ``rate * 2**32`` rounded down (every class at rate 1)."""
    return min(int(float(rate) * 2**32), 2**32)


def sampled_class_mask(
    seed,
    global_targets: torch.Tensor,
    class_start: int,
    class_stop: int,
    rate: float,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Bool ``(class_stop - class_start,)``: which of the classes ``[class_start, class_stop)`` are scored.

    ``global_targets``: the targets of every token of the global batch (any shape; ``ignore_index``
    entries are skipped). A target is always scored; any other class with probability ``rate``.
    ``seed``: an int or a one-element int64 tensor (see `keep_hash`).
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


class SampleRows(NamedTuple):
    """A sample padded to its static capacity: which rows hold a scored class (the others are padding,
    zero weights and a logit of -inf), how many classes every rank of the group scores in all (fp32,
    label smoothing's divisor) and whether any rank's sample overflowed its capacity."""

    real: torch.Tensor  # (capacity,) bool
    total: torch.Tensor  # () fp32
    overflow: torch.Tensor  # () bool


class ScoredClasses(NamedTuple):
    """What the fused loss scores on this rank: class rows, the targets in the numbering of the scored
    classes, where this rank's rows start in it, how many classes there are, the ignored label, the
    most rows any rank scores (which sizes the chunks alike on every rank) and, for a sample, which
    rows are padding."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    target: torch.Tensor
    class_start: int
    num_classes: int
    ignore_index: int
    largest_shard: int
    sample: Optional[SampleRows] = None


# A sample is padded to a capacity fixed before it is drawn, so its size is never read on the host.
# A rank where the global batch names D distinct classes scores D + Binomial(classes - D, rate) rows,
# which grows with D; so the capacity is the worst case, every token naming a distinct class here,
# plus SIGMAS standard deviations of the binomial over all the rank's classes (exceeded with a chance
# below 1e-11 per rank and call, whatever D is; that call's loss is then NaN, on every rank, and the
# step is skipped).
SIGMAS = 7


def sample_capacity(classes: int, rate: float, tokens: int) -> int:
    """Rows reserved for the sample of a rank holding ``classes`` classes at ``rate``, when the
    global batch has ``tokens`` targets."""
    if rate >= 1.0:
        return classes
    targets = min(tokens, classes)
    spread = SIGMAS * math.sqrt(classes * rate * (1.0 - rate)) + SIGMAS
    return min(classes, targets + math.ceil(rate * (classes - targets) + spread))


def sample_classes(full: ScoredClasses, seed, rate: float, global_targets: torch.Tensor, group) -> ScoredClasses:
    """Keep this rank's sampled class rows and renumber the targets over the samples of all ranks of
    ``group`` (the ranks the classes are split over), without reading anything on the host.

    Every rank holds `sample_capacity` rows, its sampled classes first in class order, then padding;
    rank ``r``'s rows are ``[r * capacity, (r + 1) * capacity)`` of the scored numbering, so only
    the count of real rows (one all-reduce, for label smoothing and the overflow vote) crosses ranks.
    A target another rank holds is renumbered into that rank's block (which row does not matter here);
    ignored targets become -1; labels outside ``[0, num_classes)`` become ``num_classes`` of the
    scored numbering (still out of range).
    """
    c_local, width = full.weight.shape
    capacity = sample_capacity(full.largest_shard, rate, global_targets.numel())
    mask = sampled_class_mask(seed, global_targets, full.class_start, full.class_start + c_local, rate,
                              full.ignore_index)
    count = mask.sum()
    real = torch.arange(capacity, device=mask.device) < count
    if c_local:
        index = torch.nonzero_static(mask, size=capacity, fill_value=0).squeeze(1)
        weight = full.weight.index_select(0, index).masked_fill(~real.unsqueeze(1), 0.0)
        bias = None if full.bias is None else full.bias.index_select(0, index)
    else:  # no class here: every row is padding (still part of the graph, as the weight is)
        weight = torch.nn.functional.pad(full.weight, (0, 0, 0, capacity))
        bias = None if full.bias is None else torch.nn.functional.pad(full.bias, (0, capacity))
    pad = torch.zeros(capacity, dtype=full.weight.dtype, device=mask.device).masked_fill_(~real, float("-inf"))
    bias = pad if bias is None else bias.masked_fill(~real, float("-inf"))

    rank, ranks = comm.group_rank(group), comm.group_size(group)
    votes = comm.all_reduce_(torch.stack([count.double(), (count > capacity).double()]), group)
    t = full.target
    valid = t != full.ignore_index
    t_local = t - full.class_start
    here = valid & (t_local >= 0) & (t_local < c_local)
    position = (mask.cumsum(0) - 1)[t_local.clamp(0, max(c_local - 1, 0))] if c_local else torch.zeros_like(t)
    elsewhere = capacity if rank == 0 else 0  # a row of another rank's block
    in_range = (t >= 0) & (t < full.num_classes)
    target = torch.where(here, rank * capacity + position, torch.where(in_range, elsewhere, ranks * capacity))
    target = torch.where(valid, target, -1)
    sample = SampleRows(real, votes[0].float(), votes[1] > 0)
    return ScoredClasses(weight, bias, target, rank * capacity, ranks * capacity, -1, capacity, sample)
