"""Asynchronous saves: the snapshot in host memory, the writing in a background thread.

`copy_to_host` snapshots the tensors a rank writes into host buffers reused from save to save
(pinned on GPUs, with one CUDA event for the background thread to wait on). `start` runs the writing and the
commit in a thread whose collectives go over a gloo group of their own (`_background_group`,
created once, collectively, by the first asynchronous save), so they never interleave with the
training's collectives. At most one save is in flight; `wait_for_checkpoints` waits for it, and
`release` (registered with `bd.destroy_parallel`'s teardown) waits and drops the group.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..parallel import schedule
from ..parallel.context import get_default_context, on_teardown

log = logging.getLogger("bigdense")

_in_flight: Optional["SaveHandle"] = None
_group: Optional[tuple] = None  # (the world group it was made for, the gloo group)
_staging: dict = {}  # (key, offsets) -> host buffer (pinned on GPUs), reused by the next save of the same tensor


class SaveHandle:
    """A checkpoint being written in the background: ``done()``, ``wait()`` (re-raises a failure)."""

    def __init__(self, path: Path):
        self.path = path
        self._finished = threading.Event()
        self._error: Optional[BaseException] = None
        self._reported = False

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """Block until the save finished; return the checkpoint directory or raise its failure."""
        self._finished.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    @property
    def failed(self) -> bool:
        return self.done() and self._error is not None

    def __repr__(self) -> str:
        state = "failed" if self.failed else "done" if self.done() else "writing"
        return f"SaveHandle({str(self.path)!r}, {state})"


def wait_for_checkpoints(raise_failure: bool = True) -> None:
    """Wait for the checkpoint save in flight, if any (collectively: every rank calls it).

    Raises the save's failure unless ``raise_failure=False`` or its handle's ``wait()`` already did.
    """
    handle = _in_flight
    if handle is None:
        return
    handle._finished.wait()
    if raise_failure and handle._error is not None and not handle._reported:
        handle._reported = True
        raise handle._error


def start(path: Path, work: Callable[[object], Path]) -> SaveHandle:
    """Run ``work(group)`` in a background thread; ``group`` carries its collectives."""
    global _in_flight
    group = _background_group()
    handle = SaveHandle(path)

    def run():
        try:
            work(group)
        except BaseException as exc:  # noqa: BLE001 - kept for wait(); the thread must not die loudly
            handle._error = exc
            log.error("background checkpoint save to %s failed: %s", path, exc)
        finally:
            handle._finished.set()

    _in_flight = handle
    threading.Thread(target=run, name=f"bigdense-save-{Path(path).name}", daemon=False).start()
    return handle


def copy_to_host(snapshot):
    """``snapshot`` with every tensor replaced by a host copy taken now.

    The host buffers (pinned on GPUs) are kept and reused by the next save of the same tensors:
    at most one save is in flight, and a fresh allocation's first touch of every page would cost
    about as much as the copy itself.
    """
    global _staging
    on_gpu = any(p.tensor.is_cuda for p in [*snapshot.model, *snapshot.optim])
    reused, staging = _staging, {}

    def copy(piece):
        t = piece.tensor.detach()
        key = (piece.key, piece.offsets)
        buf = reused.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        staging[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return dataclasses.replace(piece, tensor=buf)

    model, optim = [copy(p) for p in snapshot.model], [copy(p) for p in snapshot.optim]
    _staging = staging
    ready = None
    if on_gpu:
        ready = torch.cuda.Event()
        ready.record()
    return dataclasses.replace(snapshot, model=model, optim=optim, ready=ready)


def _background_group():
    """A gloo group over the whole world for the background saves' collectives (collective on
    first use), or ``None`` in a single process."""
    global _group
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _group is None or _group[0] is not dist.group.WORLD:
        timeout = get_default_context().timeout or datetime.timedelta(minutes=30)
        _group = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout))
        schedule.exclude_from_boundaries(_group[1])  # its collectives run on the writer's thread
    return _group[1]


def release() -> None:
    """Wait for a save in flight (its failure was logged and stays with its handle), then forget the
    background group, before the process group goes away."""
    global _group, _in_flight
    wait_for_checkpoints(raise_failure=False)
    _in_flight, _group = None, None
    _staging.clear()


on_teardown(release)
