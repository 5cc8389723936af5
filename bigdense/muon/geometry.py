"""Where the pieces of each matrix Muon orthogonalises live: which rank holds which rows and columns.

A weight of a dense layer is split up to three ways: over TP by its layer (`ShardSpec`: a balanced
slice along one dimension, packed blocks each split on their own), over DP by FSDP (the TP-local
tensor's dim 0 chunked as ``torch.chunk`` chunks it, over the ``dp_shard`` ranks), and into the
logical matrices it stacks (`LogicalBlocks`: q, k and v of a fused qkv, gate and up of a packed
``[gate; up]``). A `Piece` is what one rank holds of one logical matrix: the rows and columns of its
local tensor (``local_rows``, ``local_cols``) and where they sit in the matrix (``rows``, ``cols``); a
piece is always their product, so it is ``local[local_rows][:, local_cols]`` and goes to
``matrix[rows][:, cols]``. Every rank works out every rank's pieces from the shapes alone, with no
communication, which is what lets the exchange (`exchange.py`) size its collectives up front.

Ranks: ``rank = dp * tp_size + tp`` (the mesh's order), ``dp = replica * dp_shard + shard``: DDP has
``dp_shard = 1`` (every DP rank a replica), FSDP ``dp_shard = dp`` (no replicas), HSDP in between.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..parallel.sharding import LogicalBlocks, ShardSpec


@dataclass(frozen=True)
class Layout:
    """The TP x DP mesh, and how many DP ranks FSDP shards each TP-local tensor over (1: replicas)."""

    tp: int
    dp: int
    dp_shard: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(replica, shard, tp)`` of a world rank."""
        dp, tp = divmod(rank, self.tp)
        return dp // self.dp_shard, dp % self.dp_shard, tp

    def rank(self, replica: int, shard: int, tp: int) -> int:
        return (replica * self.dp_shard + shard) * self.tp + tp


def _as_slice(ids: torch.Tensor) -> Optional[slice]:
    """``ids`` as a slice when they are consecutive (a view instead of a gather), else None."""
    n = len(ids)
    if n == 0:
        return slice(0, 0)
    start = int(ids[0])
    return slice(start, start + n) if torch.equal(ids, torch.arange(start, start + n)) else None


class Piece:
    """What one rank holds of one matrix: ``local[local_rows][:, local_cols]``, which is
    ``matrix[rows][:, cols]``. Consecutive indices become slices (views, no kernel); index tensors
    are moved to a device once."""

    def __init__(self, local_rows, local_cols, rows, cols):
        self.local_rows, self.local_cols, self.rows, self.cols = local_rows, local_cols, rows, cols
        self._local = (_as_slice(local_rows), _as_slice(local_cols))
        self._global = (_as_slice(rows), _as_slice(cols))
        self._on: dict = {}

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.cols)

    @property
    def numel(self) -> int:
        return len(self.rows) * len(self.cols)

    def in_order(self, shape) -> bool:
        """Whether the piece is the whole matrix of ``shape``, rows and columns in order."""
        return self._global == (slice(0, shape[0]), slice(0, shape[1]))

    def _index(self, name: str, device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def _select(self, t: torch.Tensor, slices, names) -> torch.Tensor:
        for dim, (cut, name) in enumerate(zip(slices, names)):
            if cut is None:
                t = t.index_select(dim, self._index(name, t.device))
            else:
                t = t.narrow(dim, cut.start, cut.stop - cut.start)
        return t

    def _assign(self, t: torch.Tensor, slices, names, values: torch.Tensor) -> None:
        if slices[0] is not None and slices[1] is not None:
            t[slices[0], slices[1]].copy_(values)
        else:
            rows, cols = (self._index(n, t.device) for n in names)
            t[rows[:, None], cols[None, :]] = values

    def take(self, local: torch.Tensor) -> torch.Tensor:
        """This piece of a rank's local tensor."""
        return self._select(local, self._local, ("local_rows", "local_cols"))

    def put(self, local: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (shaped like the piece) into a rank's local tensor."""
        self._assign(local, self._local, ("local_rows", "local_cols"), values)

    def of_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """This piece of the whole matrix."""
        return self._select(matrix, self._global, ("rows", "cols"))

    def into_matrix(self, matrix: torch.Tensor, values: torch.Tensor) -> None:
        """Place ``values`` (shaped like the piece) in the whole matrix."""
        self._assign(matrix, self._global, ("rows", "cols"), values)


class MatrixGeometry:
    """One matrix Muon orthogonalises whole: logical block ``block`` (None: all) of a parameter.

    ``shape`` is the matrix's (rows, cols); ``flops`` its Newton-Schulz cost per step
    (`newton_schulz.ns_flops`); `piece` what a rank holds of it; `sources` the ranks an owner
    collects it from (one holder of each distinct piece, the owner's own replica's where there are
    replicas); every rank receives its own piece of the result.
    """

    def __init__(self, name: str, global_shape, spec: Optional[ShardSpec], layout: Layout,
                 blocks: Optional[LogicalBlocks] = None, block: Optional[int] = None, fsdp: bool = False):
        self.name, self.layout, self.spec = name, layout, spec
        self.global_shape = tuple(int(s) for s in global_shape)
        self.tp_split = spec is not None and spec.group == "tp" and len(spec.sizes) > 1
        self.fsdp = fsdp and layout.dp_shard > 1
        self.block_dim = None if block is None else blocks.dim
        self.block_ids = None if block is None else blocks.rows[block]
        shape = list(self.global_shape)
        if block is not None:
            shape[self.block_dim] = len(self.block_ids)
        self.shape = tuple(shape)
        self._pieces: dict[tuple[int, int], Piece] = {}

    def __repr__(self) -> str:
        return f"MatrixGeometry({self.name}, {self.shape})"

    # ---- who holds what ----
    def key(self, rank: int) -> tuple[int, int]:
        """What distinguishes a rank's piece: its TP coordinate (when split over TP) and FSDP shard."""
        _, shard, tp = self.layout.coords(rank)
        return (tp if self.tp_split else 0), (shard if self.fsdp else 0)

    def piece(self, rank: int) -> Piece:
        key = self.key(rank)
        if key not in self._pieces:
            self._pieces[key] = self._piece(*key)
        return self._pieces[key]

    def sources(self, owner: int) -> list[int]:
        """The ranks whose pieces make up the matrix, for ``owner`` to collect (in rank order)."""
        replica, shard, tp = self.layout.coords(owner)
        tps = range(self.layout.tp) if self.tp_split else [tp]
        shards = range(self.layout.dp_shard) if self.fsdp else [shard]
        return sorted(self.layout.rank(replica, s, t) for t in tps for s in shards)

    # ---- the arithmetic ----
    def _held(self, dim: int, tp: int) -> torch.Tensor:
        """Global indices along ``dim`` of the TP-local tensor of TP rank ``tp``, in local order."""
        if not self.tp_split or self.spec.dim != dim:
            return torch.arange(self.global_shape[dim])
        boxes = replace(self.spec, rank=tp).boxes()
        return torch.cat([torch.arange(g, g + n) for _, g, n in boxes])

    def _piece(self, tp: int, shard: int) -> Piece:
        held = [self._held(0, tp), self._held(1, tp)]
        if self.fsdp:  # FSDP2 chunks dim 0 of the TP-local tensor as torch.chunk does
            chunk = math.ceil(len(held[0]) / self.layout.dp_shard)
            held[0] = held[0][shard * chunk:(shard + 1) * chunk]
        local, logical = [], []
        for dim in (0, 1):
            ids = held[dim]
            if dim == self.block_dim:
                position = torch.full((self.global_shape[dim],), -1, dtype=torch.long)
                position[self.block_ids] = torch.arange(len(self.block_ids))
                at = position[ids]
                kept = (at >= 0).nonzero().flatten()
                local.append(kept)
                logical.append(at[kept])
            else:
                local.append(torch.arange(len(ids)))
                logical.append(ids)
        return Piece(local[0], local[1], logical[0], logical[1])


def matrices_of(name: str, global_shape, spec: Optional[ShardSpec], blocks: Optional[LogicalBlocks],
                layout: Layout, *, split_blocks: bool, fsdp: bool) -> list[MatrixGeometry]:
    """The matrices Muon orthogonalises in one weight: each logical block alone (``split_blocks``),
    or the whole weight as one matrix."""
    if blocks is None or not split_blocks:
        return [MatrixGeometry(name, global_shape, spec, layout, fsdp=fsdp)]
    return [MatrixGeometry(f"{name}[{j}]", global_shape, spec, layout, blocks, j, fsdp=fsdp)
            for j in range(len(blocks.rows))]
