"""Random numbers that do not depend on the tensor-parallel size.

A global 2-D tensor is cut into a fixed grid of tiles (``TILE`` x ``TILE``, independent of any
sharding). Tile ``(i, j)`` is filled by its own generator, seeded from ``(seed, i, j)``. A rank
that owns a slice of the tensor fills only the tiles its slice touches and keeps its part, so the
values it holds are bit-identical to the same slice of the unsharded tensor, at any TP size, and
no rank ever materialises the whole tensor.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

TILE = 512
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (distinct inputs give unrelated streams)."""
    h = 0
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def draw_seed() -> int:
    """One seed from torch's default CPU generator, so ``torch.manual_seed`` decides it."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


FillFn = Callable[[torch.Tensor, torch.Generator], None]


def tiled_fill_(
    out: torch.Tensor,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    seed: int,
    fill: FillFn,
    tile: int = TILE,
) -> torch.Tensor:
    """Fill ``out`` with its slice of a tiled-random global tensor.

    ``out`` is ``global[o0 : o0 + out.shape[0], o1 : o1 + out.shape[1]]`` for ``offsets = (o0, o1)``
    (1-D tensors: one offset). ``fill(tile, generator)`` fills an fp32 tile in place; the tile is
    then cast into ``out``'s dtype, so every dtype sees the same underlying draws.
    """
    if out.dim() == 1:
        tiled_fill_(out.view(1, -1), (1, global_shape[0]), (0, offsets[0]), seed, fill, tile)
        return out
    if out.dim() != 2:
        raise ValueError(f"tiled_fill_: expected a 1-D or 2-D tensor, got shape {tuple(out.shape)}")
    rows, cols = int(global_shape[0]), int(global_shape[1])
    r0, c0 = int(offsets[0]), int(offsets[1])
    r1, c1 = r0 + out.shape[0], c0 + out.shape[1]
    if r1 > rows or c1 > cols:
        raise ValueError(f"tiled_fill_: slice [{r0}:{r1}, {c0}:{c1}] exceeds global shape {(rows, cols)}")
    device = out.device
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for ti in range(r0 // tile, (r1 + tile - 1) // tile):
            tr0, tr1 = ti * tile, min((ti + 1) * tile, rows)
            for tj in range(c0 // tile, (c1 + tile - 1) // tile):
                tc0, tc1 = tj * tile, min((tj + 1) * tile, cols)
                generator.manual_seed(mix_seed(seed, ti, tj))
                block = torch.empty(tr1 - tr0, tc1 - tc0, dtype=torch.float32, device=device)
                fill(block, generator)
                # Intersection of this tile with our slice, in tile and in `out` coordinates.
                a0, a1 = max(tr0, r0), min(tr1, r1)
                b0, b1 = max(tc0, c0), min(tc1, c1)
                out[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0].copy_(block[a0 - tr0 : a1 - tr0, b0 - tc0 : b1 - tc0])
    return out
