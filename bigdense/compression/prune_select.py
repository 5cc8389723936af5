"""The global magnitude threshold of sharded weights, found exactly without gathering them.

Unstructured pruning removes the ``k`` entries of smallest ``|w|`` over a set of layers, ties
broken by the entries' global flat index (the layers in model order, each row-major in its global
shape), so the pruned set is a function of the unsharded weights alone: the same at every TP size.

The selection is a radix select over integer keys: the bit pattern of a non-negative float32 orders
as the float does, so ``key = bits(|w|) + 1`` (0 for an entry an earlier mask already removed,
which goes first) is an integer below 2^31. Four rounds of a 256-bin histogram of the next byte of
the keys still in the running, each summed over the TP group (one all-reduce of 256 counts), give
the k-th smallest key exactly; among the entries that hold it, the same select over their global
flat indices decides which go. Layers replicated over TP (a plain ``nn.Linear``) are counted on
every rank alike and added after the all-reduce, so they count once. Every rank takes the same
decisions from the same counts, so the ranks issue the same collectives. Weights are read in row
blocks of `BLOCK` entries, so the working memory is a few blocks, whatever the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ..parallel import comm

BLOCK = 1 << 22  # entries of a weight read at once
_BINS = 256


@dataclass
class Candidate:
    """One layer's share of a global selection: this rank's weight (2-D), its current mask (or
    None), ``flat_index(rows, cols)`` (global flat indices of local entries; rows and cols are
    local index tensors) and whether it is replicated over TP (counted once, not summed)."""

    weight: torch.Tensor
    mask: Optional[torch.Tensor]
    flat_index: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    replicated: bool


def magnitude_keys(weight: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 keys ordering entries by ``|w|``: ``bits(|w| as float32) + 1``, 0 where ``mask`` is False."""
    keys = weight.detach().abs().float().contiguous().view(torch.int32) + 1
    return keys if mask is None else keys.masked_fill_(~mask, 0)


def _row_blocks(c: Candidate) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first local row, keys of a block of rows)`` over this rank's weight."""
    rows = max(1, BLOCK // max(1, c.weight.shape[1]))
    for start in range(0, c.weight.shape[0], rows):
        mask = None if c.mask is None else c.mask[start:start + rows]
        yield start, magnitude_keys(c.weight[start:start + rows], mask)


def _radix_kth(values: Callable[[], Iterator[tuple[torch.Tensor, bool]]], k: int, nbits: int, group,
               device) -> tuple[int, int, int]:
    """The k-th smallest (1-based) of non-negative integers below ``2**nbits`` held across the ranks.

    ``values()`` yields ``(tensor, replicated)`` blocks each time it is called. Returns ``(value,
    j, ties)``: the k-th smallest is ``value``, it is the j-th (1-based) of the ``ties`` entries equal
    to it. One all-reduce of 256 counts per byte of ``nbits``.
    """
    top = (nbits + 7) // 8 * 8
    prefix, remaining, ties = 0, k, 0
    for shift in range(top - 8, -1, -8):
        summed = torch.zeros(_BINS, dtype=torch.int64, device=device)
        alike = torch.zeros(_BINS, dtype=torch.int64, device=device)
        for block, replicated in values():
            if shift + 8 < top:  # the entries whose higher bytes match what is decided so far
                block = block[(block >> (shift + 8)) == prefix]
            counts = torch.bincount(((block >> shift) & (_BINS - 1)).long(), minlength=_BINS)
            (alike if replicated else summed).add_(counts)
        hist = (comm.all_reduce_(summed, group) + alike).tolist()
        below = 0
        for byte, count in enumerate(hist):
            if below + count >= remaining:
                break
            below += count
        prefix, remaining, ties = (prefix << 8) | byte, remaining - below, count
    return prefix, remaining, ties


def _tie_indices(candidates: list[Candidate], key: int) -> list[torch.Tensor]:
    """Per candidate, the global flat indices of its entries whose key is ``key``."""
    out = []
    for c in candidates:
        found = []
        for start, keys in _row_blocks(c):
            rows, cols = (keys == key).nonzero(as_tuple=True)
            found.append(c.flat_index(rows + start, cols))
        out.append(torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=c.weight.device))
    return out


@dataclass
class Selection:
    """The k smallest entries: every key below ``key`` goes, and of the entries holding ``key`` those
    whose global flat index is at most ``last_index`` (all of them when it is None)."""

    key: int
    last_index: Optional[int]

    def keep_mask(self, c: Candidate) -> torch.Tensor:
        """The new mask of ``c``'s weight: True where the entry stays."""
        blocks = []
        for start, keys in _row_blocks(c):
            keep = keys > self.key
            if self.last_index is not None:
                rows, cols = (keys == self.key).nonzero(as_tuple=True)
                keep[rows, cols] = c.flat_index(rows + start, cols) > self.last_index
            blocks.append(keep)
        return torch.cat(blocks) if blocks else torch.ones_like(c.weight, dtype=torch.bool)

    @property
    def threshold(self) -> float:
        """The largest ``|w|`` that goes (0.0 when only masked entries go)."""
        bits = torch.tensor([max(self.key - 1, 0)], dtype=torch.int32)
        return float(bits.view(torch.float32)) if self.key > 0 else 0.0


def select_smallest(candidates: list[Candidate], k: int, total: int, group) -> Selection:
    """The `Selection` of the ``k`` (>= 1) entries of smallest ``(|w|, global flat index)`` among
    the ``total`` entries of ``candidates`` (collective over ``group``: every TP rank calls it)."""
    device = candidates[0].weight.device

    def keys():
        for c in candidates:
            for _, block in _row_blocks(c):
                yield block.flatten(), c.replicated

    key, position, ties = _radix_kth(keys, k, 32, group, device)
    if position == ties:  # every entry holding the key goes
        return Selection(key, None)
    indices = _tie_indices(candidates, key)

    def tied():
        yield from ((ix, c.replicated) for ix, c in zip(indices, candidates))

    last, _, _ = _radix_kth(tied, position, max(1, (total - 1).bit_length()), group, device)
    return Selection(key, last)
