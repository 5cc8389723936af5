"""Which rank orthogonalises which matrix, and in which round: each matrix once, FLOP-balanced.

Matrices are taken largest first (Newton-Schulz FLOPs, `newton_schulz.ns_flops`) in rounds of at
most one per rank, so no rank holds more than one whole matrix (and its iterates) at a time; within
a round the largest goes to the rank with the least work so far (longest-processing-time first,
ties to the lower rank). Every rank computes the same assignment from the shapes alone.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Assignment:
    owners: tuple[int, ...]  # owners[m]: the rank that orthogonalises matrix m
    rounds: tuple[tuple[int, ...], ...]  # matrix indices of each round, at most one per rank
    work: tuple[int, ...]  # Newton-Schulz FLOPs per rank per step

    def owned_by(self, rank: int) -> list[int]:
        return [m for m, owner in enumerate(self.owners) if owner == rank]


def assign(flops: list[int], world: int) -> Assignment:
    """Owners and rounds for matrices of the given costs over ``world`` ranks."""
    order = sorted(range(len(flops)), key=lambda m: (-flops[m], m))
    owners, work, rounds = [0] * len(flops), [0] * world, []
    for start in range(0, len(order), world):
        chunk, free = order[start:start + world], set(range(world))
        for m in chunk:
            rank = min(free, key=lambda r: (work[r], r))
            free.discard(rank)
            owners[m] = rank
            work[rank] += flops[m]
        rounds.append(tuple(sorted(chunk)))
    return Assignment(tuple(owners), tuple(rounds), tuple(work))
