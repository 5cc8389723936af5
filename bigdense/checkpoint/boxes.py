"""Boxes: where a stored piece sits in its global tensor (``offsets`` and ``shape`` in global
coordinates), and the arithmetic a resharding load and a flat ZeRO fragment need."""
from __future__ import annotations

import math
from typing import Sequence

import torch




def box_overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]):
    """The intersection of two boxes as ``(offsets, shape)``, or ``None`` if it is empty."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


def narrow_box(t: torch.Tensor, t_off: Sequence[int], off: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The part of ``t`` (which sits at ``t_off`` in global coordinates) covering the box ``off/shape``."""
    for d, (o, to, n) in enumerate(zip(off, t_off, shape)):
        t = t.narrow(d, o - to, n)
    return t


def volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[list[int], list[int], int]]:
    """The elements ``start:end`` of a row-major tensor of ``shape``, as boxes ``(offsets, shape,
    flat start)``: at most two partial rows per dimension around one block of whole rows, each box
    contiguous in the flat order (so a flat fragment, such as a ZeRO partition's, stores as boxes)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [([start] if shape else [], [end - start] if shape else [], start)]
    inner = volume(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def within_row(row: int, lo: int, hi: int):
        return [([row, *off], [1, *shp], row * inner + flat) for off, shp, flat in flat_range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return within_row(r0, c0, c1)
    boxes = []
    if c0 > 0:
        boxes += within_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(([r0] + [0] * (len(shape) - 1), [r1 - r0, *shape[1:]], r0 * inner))
    if c1 > 0:
        boxes += within_row(r1, 0, c1)
    return boxes
