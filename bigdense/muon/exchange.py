"""Moving whole matrices to the rank that orthogonalises them, and their results back.

Two schemes, both on the same `Assignment` (each matrix one owner, rounds of at most one matrix per
rank), so they move exactly the same bytes:

* ``all_to_all`` (Essential AI's layer sharding): per round, one all-to-all brings every piece of
  every matrix of the round to its owner, and one takes every rank's piece of every result back:
  two collectives per round.
* ``gather`` (PyTorch's design note for distributed Muon): per matrix, the sources' pieces go to its
  owner and the owner sends each rank its piece of the result: two collectives per matrix (a
  round's are issued together). On the wire each is an all-to-all in which only the owner receives
  (or sends), which is how NCCL runs a gather or scatter anyway (grouped send/receive), and which
  takes uneven pieces without padding on gloo.

A rank sends each owner its piece of the update only where it is the owner's chosen source
(`MatrixGeometry.sources`: DDP replicas send nothing twice) and receives its own piece of every
result. Split sizes follow from the shapes alone (`geometry.py`): nothing is asked of the device on
the host. `bytes_sent` counts what a rank sends per step, the number the planner reports.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..parallel import comm
from .assignment import Assignment, assign
from .geometry import Layout, MatrixGeometry

SCHEMES = ("all_to_all", "gather")  # optim.muon_comm


class Exchange:
    """The step's traffic for ``matrices`` (the same list, in the same order, on every rank)."""

    def __init__(self, matrices: Sequence[MatrixGeometry], flops: Sequence[int], layout: Layout, rank: int,
                 group, scheme: str = "all_to_all"):
        self.matrices, self.layout, self.rank, self.group, self.scheme = list(matrices), layout, rank, group, scheme
        self.assignment: Assignment = assign(list(flops), layout.world)
        owners = self.assignment.owners
        # Each batch is one collective pair: a whole round, or one matrix of it.
        self.rounds = [[r] if scheme == "all_to_all" else [(m,) for m in r] for r in self.assignment.rounds]
        self._sources = [m.sources(owner) for m, owner in zip(self.matrices, owners)]

    # ---- sizes ----
    def _gather_splits(self, batch, rank: int) -> tuple[list[int], list[int]]:
        """(``rank``'s input splits, its output splits) of the collective bringing ``batch`` to owners."""
        world, owners = self.layout.world, self.assignment.owners
        send, recv = [0] * world, [0] * world
        for m in batch:
            if rank in self._sources[m]:
                send[owners[m]] += self.matrices[m].piece(rank).numel
            if owners[m] == rank:
                for src in self._sources[m]:
                    recv[src] += self.matrices[m].piece(src).numel
        return send, recv

    def _scatter_splits(self, batch, rank: int) -> tuple[list[int], list[int]]:
        world, owners = self.layout.world, self.assignment.owners
        send, recv = [0] * world, [0] * world
        for m in batch:
            if owners[m] == rank:
                for dst in range(world):
                    send[dst] += self.matrices[m].piece(dst).numel
            recv[owners[m]] += self.matrices[m].piece(rank).numel
        return send, recv

    def bytes_sent(self, rank: int, element_size: int) -> int:
        """What ``rank`` sends to other ranks per step (both directions), in bytes."""
        total = 0
        for batches in self.rounds:
            for batch in batches:
                for splits in (self._gather_splits(batch, rank)[0], self._scatter_splits(batch, rank)[0]):
                    total += sum(splits) - splits[rank]
        return total * element_size

    def collectives(self) -> int:
        """Collectives per step (on every rank alike): two per round, or two per matrix."""
        return 2 * sum(len(batches) for batches in self.rounds) if self.layout.world > 1 else 0

    # ---- the step ----
    def run(self, pieces: list, orthogonalize: Callable[[int, torch.Tensor], torch.Tensor],
            deliver: Callable[[int, torch.Tensor], None]) -> None:
        """``pieces[m]``: this rank's piece of matrix ``m``'s update (shaped as its `Piece`, in the
        dtype to send); each entry is dropped (set to None) once sent. ``orthogonalize(m, whole)``
        runs once, on ``m``'s owner. ``deliver(m, values)`` takes this rank's piece of ``m``'s result
        as soon as its round brings it (a view of a receive buffer, valid during the call), so
        results never pile up: a round's buffers are all the exchange holds at once."""
        like = pieces[0].new_empty(0) if pieces else None
        if self.layout.world == 1:  # every matrix whole here: nothing to move
            for m in range(len(pieces)):
                values, pieces[m] = pieces[m], None
                deliver(m, self._alone(m, values, orthogonalize))
            return
        for batches in self.rounds:
            pending = [self._start_gather(batch, pieces, like) for batch in batches]
            results = {}
            for batch, work in zip(batches, pending):
                for m, whole in self._assemble(batch, work.wait(), like).items():
                    results[m] = orthogonalize(m, whole)
            pending = [self._start_scatter(batch, results, like) for batch in batches]
            del results
            for batch, work in zip(batches, pending):
                self._deliver_mine(batch, work.wait(), deliver)

    def _alone(self, m: int, piece_values: torch.Tensor, orthogonalize) -> torch.Tensor:
        """One process: the piece is the matrix, its rows and columns perhaps in another order."""
        piece = self.matrices[m].piece(0)
        whole = piece_values
        if not piece.in_order(self.matrices[m].shape):
            whole = piece_values.new_empty(self.matrices[m].shape)
            piece.into_matrix(whole, piece_values)
        result = orthogonalize(m, whole)
        return result if whole is piece_values else piece.of_matrix(result)

    def _start_gather(self, batch, pieces: list, like: torch.Tensor) -> comm.Pending:
        send, recv = self._gather_splits(batch, self.rank)
        owners = self.assignment.owners
        chunks = [pieces[m].reshape(-1) for dst in range(self.layout.world) for m in batch
                  if owners[m] == dst and self.rank in self._sources[m]]
        data = torch.cat(chunks) if chunks else like.new_empty(0)
        for m in batch:
            pieces[m] = None  # sent (the concatenation is a copy)
        return comm.all_to_all_start(like.new_empty(sum(recv)), data, recv, send, self.group)

    def _assemble(self, batch, received: torch.Tensor, like: torch.Tensor) -> dict[int, torch.Tensor]:
        """The whole matrices this rank owns in ``batch``, from the received pieces (source-major order)."""
        mine = [m for m in batch if self.assignment.owners[m] == self.rank]
        wholes = {m: like.new_empty(self.matrices[m].shape) for m in mine}
        offset = 0
        for src in range(self.layout.world):
            for m in mine:
                if src not in self._sources[m]:
                    continue
                piece = self.matrices[m].piece(src)
                piece.into_matrix(wholes[m], received[offset:offset + piece.numel].view(piece.shape))
                offset += piece.numel
        return wholes

    def _start_scatter(self, batch, results: dict, like: torch.Tensor) -> comm.Pending:
        send, recv = self._scatter_splits(batch, self.rank)
        chunks = []
        for dst in range(self.layout.world):
            for m in batch:
                if self.assignment.owners[m] == self.rank:
                    chunks.append(self.matrices[m].piece(dst).of_matrix(results[m]).reshape(-1))
        data = torch.cat(chunks) if chunks else like.new_empty(0)
        return comm.all_to_all_start(like.new_empty(sum(recv)), data, recv, send, self.group)

    def _deliver_mine(self, batch, received: torch.Tensor, deliver) -> None:
        offset = 0
        for src in range(self.layout.world):
            for m in batch:
                if self.assignment.owners[m] == src:
                    piece = self.matrices[m].piece(self.rank)
                    deliver(m, received[offset:offset + piece.numel].view(piece.shape))
                    offset += piece.numel
