"""Every rank learns of every rank's failure: the collective step that keeps checkpoints from hanging.

A save or load is a sequence of local phases separated by `agree` calls. Each phase runs in a
try block; `agree` then exchanges one short error string per rank over the world group. If any
rank failed, every rank raises the same `CheckpointError` (naming the first failing rank), so no
rank waits in a collective for a peer that gave up, and no rank goes on to modify the model while
another refuses the checkpoint.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import torch.distributed as dist

from .format import CheckpointError, CheckpointMismatch


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def world_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_objects(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` in rank order, over ``group`` (default: the world; a group passed here
    spans the whole world too, such as the background saves' own)."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def agree(what: str, fn: Callable[[], Any], *, gather: bool = False, group=None) -> Any:
    """Run ``fn()`` here; raise on every rank if it raised on any.

    Returns ``fn()``'s result, or with ``gather=True`` every rank's result in rank order (the
    results travel with the error strings, in the same collective, over ``group``). The error is
    the first failing rank's; a `CheckpointMismatch` stays one on every rank. When every rank
    failed with the same message, the message does not name ranks.
    """
    local: Optional[BaseException] = None
    message = mismatch = None
    result = None
    try:
        result = fn()
    except CheckpointError as exc:
        local, message, mismatch = exc, str(exc), isinstance(exc, CheckpointMismatch)
    except Exception as exc:  # noqa: BLE001 - an unexpected failure must reach the other ranks too
        local = exc
        message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    exchanged = all_gather_objects((message, mismatch, result if gather else None), group)
    failed = [(rank, m, kind) for rank, (m, kind, _) in enumerate(exchanged) if m is not None]
    if failed:
        first_rank, first_message, first_mismatch = failed[0]
        others = [rank for rank, _, _ in failed[1:]]
        also = f" (ranks {others} failed too)" if others else ""
        alike = len(failed) == len(exchanged) and len({m for _, m, _ in failed}) == 1
        where = f" on rank {first_rank} of {len(exchanged)}{also}" if len(exchanged) > 1 and not alike else ""
        error = CheckpointMismatch if first_mismatch else CheckpointError
        raise error(f"{what} failed{where}: {first_message}") from local
    return [r for _, _, r in exchanged] if gather else result
