"""Who writes which tensor: every rank its share, so a save's bytes spread over the whole job.

A sharded tensor's boxes differ per TP rank; a tensor replicated over TP is written from TP rank
0's copy. The DP replicas of a TP rank hold the same tensors, so they share them out: the largest
first, each to the replica with the fewest bytes so far (every replica computes the same
assignment from the same list, with no communication), and each writes about 1/dp of the bytes.
A ZeRO partition's fragments and an FSDP shard are held by one DP rank only (``Piece.dp_owned``;
under HSDP, by one rank per replica, the first of which writes them): that rank writes them.
"""
from __future__ import annotations

from .pieces import Piece


def piece_bytes(piece: Piece) -> int:
    return piece.tensor.numel() * piece.tensor.element_size()


def assign_writes(pieces: list[Piece], tp_rank: int, dp_rank: int, dp_size: int) -> list[Piece]:
    """The pieces this rank (at ``tp_rank``, ``dp_rank``) writes, in a fixed order."""
    # A sharded tensor's empty boxes (more TP ranks than rows) are simply absent.
    candidates = [p for p in pieces if (p.sharded and p.tensor.numel() > 0) or (not p.sharded and tp_rank == 0)]
    mine = [p for p in candidates if p.dp_owned and not p.replica and p.tensor.numel() > 0]
    shared = sorted((p for p in candidates if not p.dp_owned), key=lambda p: (-piece_bytes(p), p.key))
    loads = [0] * dp_size
    for p in shared:
        target = min(range(dp_size), key=lambda r: (loads[r], r))
        loads[target] += piece_bytes(p)
        if target == dp_rank:
            mine.append(p)
    return sorted(mine, key=lambda p: (p.key, p.offsets))


def name_in_file(piece: Piece) -> str:
    """The tensor's name inside its safetensors file: ``mlp.up.weight``, ``mlp.up.weight/exp_avg``;
    a fragment or a packed parameter's box (several per tensor in one file) also carries its
    offsets: ``...@0,128``."""
    name = piece.key.split("/", 1)[1]
    return f"{name}@{','.join(map(str, piece.offsets))}" if piece.dp_owned or piece.split else name
