"""Random numbers that do not depend on the tensor-parallel size: seeds, the counter hash, and
initialisation fills.

Element ``(row, col)`` of a global tensor (viewed as 2-D) is a pure function of a hash of
``(key, row, col)`` (`hash_words`), a fixed handful of vectorised integer ops on whole tensors. A
rank computes exactly its slice from the global indices of its elements, so the values it holds are
bit-identical to the same slice of the unsharded tensor, at any TP size, and the number of kernels
does not grow with the tensor. Initialisation (`counter_fill_`) turns the hash words into uniform,
normal or truncated-normal values (`uniform_symmetric`, `standard_normal`, `truncated_normal`;
normals by inverse CDF, with no rejection loop), in chunks of at most ``CHUNK`` elements, so
temporaries stay bounded for any shard. Dropout masks use the same hash (`bigdense.parallel.dropout`).

`tiled_fill_` (a fixed grid of ``TILE`` x ``TILE`` tiles, a torch.Generator seeded per tile) is the
generator path kept for user-supplied fills, which need torch's generator API.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..kernels.counter_hash import M1, fmix32  # noqa: F401 - M1 re-exported for dropout.py; fmix32 hashes here too

TILE = 512
# Elements hashed at once by `counter_fill_` on an accelerator: bounds its temporaries (a few
# int32/fp32 tensors of this size, 64 MiB each) whatever the shard, with few, large kernels.
CHUNK = 1 << 24
# The same on CPU, where an op launches no kernel but a block that fits in cache keeps the twenty
# or so passes over it from streaming main memory (several times faster than CHUNK-sized blocks).
CPU_CHUNK = 1 << 16
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
    """One seed from torch's default CPU generator, so ``torch.manual_seed`` decides it (also inside
    ``with torch.device("meta")``, so a model built there draws the seeds an eager build draws)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu").item())


FillFn = Callable[[torch.Tensor, torch.Generator], None]


def tiled_fill_(
    out: torch.Tensor,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    seed: int,
    fill: FillFn,
    tile: int | tuple[int, int] = TILE,
) -> torch.Tensor:
    """Fill ``out`` with its slice of a tiled-random global tensor.

    ``out`` is ``global[o0 : o0 + out.shape[0], o1 : o1 + out.shape[1]]`` for ``offsets = (o0, o1)``
    (1-D tensors: one offset). ``fill(tile, generator)`` fills an fp32 tile in place; the tile is
    then cast into ``out``'s dtype, so every dtype sees the same underlying draws. ``tile`` is the
    grid's tile shape; it must depend on the global shape only, never on the sharding.
    """
    if out.dim() == 1:
        tiled_fill_(out.view(1, -1), (1, global_shape[0]), (0, offsets[0]), seed, fill, tile)
        return out
    if out.dim() != 2:
        raise ValueError(f"tiled_fill_: expected a 1-D or 2-D tensor, got shape {tuple(out.shape)}")
    tile_rows, tile_cols = (tile, tile) if isinstance(tile, int) else tile
    rows, cols = int(global_shape[0]), int(global_shape[1])
    r0, c0 = int(offsets[0]), int(offsets[1])
    r1, c1 = r0 + out.shape[0], c0 + out.shape[1]
    if r1 > rows or c1 > cols:
        raise ValueError(f"tiled_fill_: slice [{r0}:{r1}, {c0}:{c1}] exceeds global shape {(rows, cols)}")
    device = out.device
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for ti in range(r0 // tile_rows, -(-r1 // tile_rows)):
            tr0, tr1 = ti * tile_rows, min((ti + 1) * tile_rows, rows)
            for tj in range(c0 // tile_cols, -(-c1 // tile_cols)):
                tc0, tc1 = tj * tile_cols, min((tj + 1) * tile_cols, cols)
                generator.manual_seed(mix_seed(seed, ti, tj))
                block = torch.empty(tr1 - tr0, tc1 - tc0, dtype=torch.float32, device=device)
                fill(block, generator)
                # Intersection of this tile with our slice, in tile and in `out` coordinates.
                a0, a1 = max(tr0, r0), min(tr1, r1)
                b0, b1 = max(tc0, c0), min(tc1, c1)
                out[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0].copy_(block[a0 - tr0 : a1 - tr0, b0 - tc0 : b1 - tc0])
    return out


def hash_words(seed: int, rows: tuple[int, int], cols: tuple[int, int], device) -> torch.Tensor:
    """The int32 hash words (``(n, m)``) of rows ``[r0, r0 + n)`` and columns ``[c0, c0 + m)`` of a
    global tensor for integer key ``seed``; ``rows = (r0, n)``, ``cols = (c0, m)``. The word rule of
    `keep_mask`, keyed by two 32-bit words of ``mix_seed(seed)``: a slice's words are those the whole
    tensor gives it (`words_of` decides index by index)."""
    key = mix_seed(seed)
    key0, key1 = (key & 0xFFFFFFFF) - (1 << 31), ((key >> 32) & 0x7FFFFFFF)
    row_words = index_words(rows[0], rows[1], M1, device)
    col_words = index_words(cols[0], cols[1], GOLDEN, device)
    return fmix32((row_words ^ key0).unsqueeze(1) ^ (col_words + key1).unsqueeze(0))


def uniform_symmetric(words: torch.Tensor) -> torch.Tensor:
    """U(-1, 1) in fp32 from the top 24 bits of each word: ``(k + 1/2) / 2^23`` for the signed
    ``k = word >> 8`` in [-2^23, 2^23), exact in fp32, symmetric about 0, never reaching +-1."""
    return ((words >> 8).to(torch.float32) + 0.5) * 2.0**-23


def standard_normal(words: torch.Tensor) -> torch.Tensor:
    """N(0, 1) in fp32 by inverse CDF: the top bit is the sign, the next 24 bits a uniform ``v`` in
    [0, 1), and the magnitude ``sqrt(2) erfinv(v)`` (the largest is about 5.4)."""
    return _signed_half_normal(words, 1.0)


def truncated_normal(words: torch.Tensor, bound: float = 2.0) -> torch.Tensor:
    """N(0, 1) restricted to [-bound, bound], in fp32, exactly (no rejection): `standard_normal`'s
    inverse CDF with ``v`` restricted to [0, erf(bound / sqrt(2)))."""
    return _signed_half_normal(words, math.erf(bound / math.sqrt(2.0))).clamp_(-bound, bound)


def _signed_half_normal(words: torch.Tensor, top: float) -> torch.Tensor:
    """sign(word) * sqrt(2) erfinv(v * top), ``v`` from bits 30..7 (24 bits, exact in fp32)."""
    v = ((words >> 7) & 0xFFFFFF).to(torch.float32) * (top * 2.0**-24)
    magnitude = torch.erfinv(v) * math.sqrt(2.0)
    return torch.where(words < 0, -magnitude, magnitude)


def counter_fill_(
    out: torch.Tensor,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    seed: int,
    law: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Fill ``out`` with its slice of the counter-based random global tensor for ``seed``.

    ``out`` is ``global[o0 : o0 + out.shape[0], o1 : o1 + out.shape[1]]`` for ``offsets = (o0, o1)``
    (1-D tensors: one offset). ``law(words)`` turns int32 `hash_words` into fp32 values, which are
    cast into ``out``'s dtype, so every dtype sees the same draws. Generated on ``out``'s device in
    blocks of at most ``CHUNK`` elements (``CPU_CHUNK`` on CPU): a fixed number of ops per block,
    and size / CHUNK blocks. The values do not depend on the block size.
    """
    if out.dim() == 1:
        counter_fill_(out.view(1, -1), (1, global_shape[0]), (0, offsets[0]), seed, law)
        return out
    if out.dim() != 2:
        raise ValueError(f"counter_fill_: expected a 1-D or 2-D tensor, got shape {tuple(out.shape)}")
    (n, m), (r0, c0) = out.shape, (int(offsets[0]), int(offsets[1]))
    if r0 + n > int(global_shape[0]) or c0 + m > int(global_shape[1]):
        raise ValueError(f"counter_fill_: slice [{r0}:{r0 + n}, {c0}:{c0 + m}] exceeds global shape "
                         f"{tuple(global_shape)}")
    chunk = CPU_CHUNK if out.device.type == "cpu" else CHUNK
    block_cols = max(1, min(m, chunk))
    block_rows = max(1, chunk // block_cols)
    with torch.no_grad():
        for i in range(0, n, block_rows):
            rows = min(block_rows, n - i)
            for j in range(0, m, block_cols):
                cols = min(block_cols, m - j)
                words = hash_words(seed, (r0 + i, rows), (c0 + j, cols), out.device)
                out[i : i + rows, j : j + cols].copy_(law(words))
    return out


# Counter-based hashing in int32 arithmetic: MurmurHash3's finaliser and its constants live with
# the kernels that hash too (`bigdense.kernels.counter_hash`); GOLDEN spreads column indices.
GOLDEN = 0x9E3779B9 - (1 << 32)


def index_words(start: int, count: int, odd: int, device) -> torch.Tensor:
    """The global indices ``start .. start + count - 1`` spread over 32-bit words (int32, (count,)):
    times an odd constant, a bijection modulo 2^32 (see `words_of` past 2^31)."""
    wide = start + count > 2**31
    return words_of(torch.arange(start, start + count, dtype=torch.int64 if wide else torch.int32, device=device),
                    odd, wide)


def words_of(index: torch.Tensor, odd: int, wide: bool) -> torch.Tensor:
    """The word of each index: ``index * odd`` modulo 2^32 below 2^31; from 2^31 on, the high word,
    mixed, is folded into it too. Decided index by index, so a slice of a range gives each index the
    word the whole range gives it, whichever rank holds it. ``wide``: some index may reach 2^31
    (only then is the second form computed)."""
    low = (index & 0xFFFFFFFF).to(torch.int32) * odd if wide else index.to(torch.int32) * odd
    if not wide:
        return low
    return torch.where(index < 2**31, low, low ^ fmix32((index >> 32).to(torch.int32) ^ GOLDEN))
