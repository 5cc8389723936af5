"""Which rank hashes which stored shard on load: each byte is verified once per node by default.

The ranks of a node read shards through one page cache; a shard hashed by one of them is hashed
for all, so by default (``"node"``) each stored shard that any rank of a node reads is hashed by
one reader on that node (the one with the fewest bytes to hash so far). ``"first"``: once in the
whole job, by the lowest-numbered rank that reads it (a shared filesystem that shows every node
the same bytes). ``"all"``: every rank hashes every shard it reads. ``"none"``: no hashing (sizes
and headers are still checked).
"""
from __future__ import annotations

import socket

from ..errors import check_choice

VERIFY_MODES = ("node", "first", "all", "none")


def verify_mode(verify) -> str:
    """``verify`` as one of `VERIFY_MODES` (``True`` is the default ``"node"``, ``False`` is ``"none"``)."""
    if verify is True:
        return "node"
    if verify is False:
        return "none"
    return check_choice("load_checkpoint: verify", verify, VERIFY_MODES, error=ValueError)


def node_name() -> str:
    return socket.gethostname()


def assign_hashing(mode: str, reads_per_rank: list[dict], nodes: list[str], rank: int) -> set:
    """The stored shards ``rank`` hashes. ``reads_per_rank[r]``: ``{(file, name): bytes}`` rank r
    reads from; ``nodes[r]``: its node. Every rank computes the same answer from the same lists."""
    if mode == "none":
        return set()
    if mode == "all":
        return set(reads_per_rank[rank])
    mine, loads = set(), [0] * len(reads_per_rank)
    group_of = (lambda r: nodes[r]) if mode == "node" else (lambda r: "")
    shards = sorted({(group_of(r), shard, size) for r, reads in enumerate(reads_per_rank) for shard, size in reads.items()},
                    key=lambda s: (s[0], -s[2], s[1]))
    for group, shard, size in shards:
        readers = [r for r, reads in enumerate(reads_per_rank) if shard in reads and group_of(r) == group]
        who = readers[0] if mode == "first" else min(readers, key=lambda r: (loads[r], r))
        loads[who] += size
        if who == rank:
            mine.add(shard)
    return mine
