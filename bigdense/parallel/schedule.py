"""The collective-schedule check: every rank of a group issues the same collectives in the same order.

A collective that one rank issues and its peers do not (or issue with another size, or at another
point of the backward) hangs the job until the deadline, aborts it (gloo: "Received data size
doesn't match expected size") or, on NCCL, can pair the wrong buffers silently. With the check on,
every collective bigdense issues (`bigdense.parallel.comm`) first agrees with its peers, out of
band, through the process group's key-value store (never through the group itself, so the check
cannot be the thing that mismatches): each rank posts what it is about to issue -- kind, shape
and dtype of the buffer handed to the backend, reduce op, phase (forward, backward, or a
checkpointed block's recompute) and the layer that issues it -- and reads its peers'. A
difference raises `ScheduleMismatch` on every rank of the group, naming the collective's number,
each rank's collective and layer, before anything is sent; a rank that does not arrive within the
check's deadline is named as missing. Every rank that waits anywhere learns of a failure at once
(one shared abort key), so the whole job stops in seconds.

The end of every outermost module forward, and of the backward that follows it, is posted too (a
"boundary"), so a rank that skips the *last* collective of a pass meets its peers' collective with
its boundary instead of leaving them waiting.

    BIGDENSE_CHECK_SCHEDULE=1 torchrun ... launch/train.py       # the whole run
    with bd.check_schedule():  ...                               # a block (tests, a suspect step)
    bd.check_schedule(True, timeout=10)                          # process-wide, 10 s deadline

Off by default, and then free: `comm` tests one module flag per collective and the region wrappers
one per call; no hook is installed. On, each collective costs a few store round trips (a debug
switch, not for production runs). Collectives traced by ``torch.compile`` are not checked (the
compiler schedules them), nor those of torch's "fake" backend (one process, no peers), nor object
collectives outside `comm` (configuration agreement).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..host_checks import env_flag
from .context import get_default_context, on_teardown

log = logging.getLogger("bigdense")
_ENV, _ENV_TIMEOUT = "BIGDENSE_CHECK_SCHEDULE", "BIGDENSE_CHECK_SCHEDULE_TIMEOUT"
_TAG = "bigdense.layer"  # key of an autograd node's metadata: the layer whose forward made the node
_PREFIX = "bigdense/schedule"
DEFAULT_TIMEOUT_S = 30.0


class ScheduleMismatch(RuntimeError):
    """The ranks of a process group were about to issue different collectives (or one is missing)."""


def _env_timeout() -> float:
    raw = os.environ.get(_ENV_TIMEOUT, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"bigdense: {_ENV_TIMEOUT} must be a positive number of seconds, got {raw!r}")
    return value


_enabled = False
_timeout_s = DEFAULT_TIMEOUT_S


def enabled() -> bool:
    """Whether collectives are checked now."""
    return _enabled


def _set(flag: bool, timeout: float) -> None:
    global _enabled, _timeout_s
    _enabled, _timeout_s = flag, timeout
    _hooks.install() if flag else _hooks.remove()


class check_schedule:
    """Turn the collective-schedule check on (or off); usable as a call or as a context manager.

    ``timeout``: seconds a rank waits for its peers' entry before naming them missing (default
    ``BIGDENSE_CHECK_SCHEDULE_TIMEOUT`` or 30). Every rank must turn it on alike (the environment
    variable does that under a launcher). Called plainly it sets the process-wide value; as a
    context manager it restores the previous one on exit.
    """

    def __init__(self, enabled: bool = True, *, timeout: Optional[float] = None):
        if not isinstance(enabled, bool):
            raise TypeError(f"bd.check_schedule: expected True or False, got {enabled!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"bd.check_schedule: timeout must be a positive number of seconds, got {timeout!r}")
        self._previous = (_enabled, _timeout_s)
        _set(enabled, float(timeout) if timeout is not None else _timeout_s)

    def __enter__(self) -> "check_schedule":
        return self

    def __exit__(self, *exc) -> None:
        _set(*self._previous)


# ---- where a collective comes from: phase and layer ----
_names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
_roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_HERE = {__file__, os.path.join(os.path.dirname(__file__), "comm.py")}


def _module_label(module: nn.Module) -> str:
    name = _names.get(module)
    kind = type(module).__name__
    return f"{name} ({kind})" if name else kind


def _register_names(root: nn.Module) -> None:
    """Qualified names of ``root``'s modules, as ``root.named_modules()`` gives them (the root: its class)."""
    if root in _roots:
        return
    _roots.add(root)
    for name, module in root.named_modules():
        if name:
            _names[module] = name


def origin() -> tuple[str, str, str]:
    """``(phase, layer, code)`` of the collective being issued.

    phase: ``forward``; ``backward``; ``recompute`` (a checkpointed module's forward re-run during
    the backward); ``step`` (code outside any module and outside autograd: an engine's gradient
    sum, a checkpoint). layer: the innermost module whose method issues it -- in the backward, the
    layer whose forward made the autograd node (`tag`) -- or, outside modules, the function.
    code: the first line outside `comm` (for the message only)."""
    node = torch._C._current_autograd_node()
    frame, code, function = sys._getframe(1), "", ""
    while frame is not None:
        f_code = frame.f_code
        if not code and f_code.co_filename not in _HERE:
            function = getattr(f_code, "co_qualname", f_code.co_name)
            code = f"{os.path.basename(f_code.co_filename)}:{frame.f_lineno} in {function}"
        owner = frame.f_locals.get("self") if "self" in f_code.co_varnames else None
        if isinstance(owner, nn.Module):
            return ("forward" if node is None else "recompute"), _module_label(owner), code
        if f_code.co_name == "backward" and "ctx" in f_code.co_varnames:
            break  # an autograd Function's backward: the layer is the node's
        frame = frame.f_back
    if node is not None:
        return "backward", node.metadata.get(_TAG) or node.name(), code
    return "step", function or "?", code


def tag(out):
    """Name, on ``out``'s autograd node, the layer whose forward made it, so the check can name that
    layer when the node's backward issues a collective. Returns ``out`` (a tensor or a tuple)."""
    if not _enabled:
        return out
    first = out[0] if isinstance(out, tuple) else out
    node = getattr(first, "grad_fn", None)
    if node is not None and _TAG not in node.metadata:
        node.metadata[_TAG] = origin()[1]
    return out


# ---- agreement through the store ----
class _GroupState:
    def __init__(self, group):
        self.name = group.group_name
        self.ranks = dist.get_process_group_ranks(group)
        self.seq = 0
        self.lock = threading.Lock()
        # torch's "fake" backend (one process playing one rank: shape-only runs) has no peers to
        # agree with, nor a store that holds anything.
        self.checked = dist.get_backend(group) != "fake"


_groups: dict[str, _GroupState] = {}
_excluded: set[str] = set()  # groups whose collectives run on their own thread (no boundaries there)
_epoch = 0  # advanced by `reset` (collectively, at teardown): keys of an earlier mesh are never read


def exclude_from_boundaries(group) -> None:
    """``group``'s collectives run on a thread of their own (the background checkpoint writer):
    they are checked, but boundaries, posted from the training thread, are not placed among them."""
    _excluded.add(group.group_name)


def reset() -> None:
    """Forget every group (on every rank at `bd.destroy_parallel`, whose teardown calls it)."""
    global _epoch
    _groups.clear()
    _excluded.clear()
    _epoch += 1


on_teardown(reset)


def _store():
    return dist.distributed_c10d._get_default_store()


def _group_label(state: _GroupState) -> str:
    ctx = get_default_context()
    for what, group in (("TP", ctx.tp_group), ("DP", ctx.dp_group)):
        if group is not None and group.group_name == state.name:
            return f"the {what} group (global ranks {state.ranks})"
    if len(state.ranks) == dist.get_world_size():
        return f"the world group (global ranks {state.ranks})"
    return f"group {state.name} (global ranks {state.ranks})"


def _describe(entry: dict) -> str:
    if entry["kind"] == "boundary":
        return f"no collective: it reached the {entry['layer']} [{entry['code']}]"
    op = f" {entry['op']}" if entry.get("op") else ""
    where = (f"outside the model, in {entry['layer']}" if entry["phase"] == "step"
             else f"in the {entry['phase']} of {entry['layer']}")
    return f"{entry['kind']}{op} of {entry['dtype']} {tuple(entry['shape'])} {where} [{entry['code']}]"


_COMPARED = ("kind", "shape", "dtype", "op", "phase", "layer")


def agree(kind: str, group, tensor: torch.Tensor, op: Optional[str] = None) -> None:
    """Before issuing collective ``kind`` on ``group`` with buffer ``tensor``: check that every rank of
    the group issues the same one now; raise `ScheduleMismatch` on every rank if not."""
    state = _groups.get(group.group_name)
    if state is None:
        if not _groups:  # (said at the first check, once the job's logging is set up)
            log.info("collective-schedule check on: the ranks agree on every collective before it is issued "
                     "(deadline %g s)", _timeout_s)
        state = _groups.setdefault(group.group_name, _GroupState(group))
    if not state.checked:
        return
    phase, layer, code = origin()
    entry = {"kind": kind, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
             "op": op or "", "phase": phase, "layer": layer, "code": code, "rank": dist.get_rank()}
    with state.lock:
        seq, state.seq = state.seq, state.seq + 1
        _exchange(state, seq, entry)


def boundary(label: str) -> None:
    """Post "no collective here: ``label``" on every group this rank has used (in one global order),
    so that a peer waiting for a collective this rank skipped learns of it now."""
    if not _enabled or not dist.is_initialized():
        return
    for name in sorted(_groups):
        state = _groups[name]
        if name in _excluded or not state.checked:
            continue
        entry = {"kind": "boundary", "shape": [], "dtype": "", "op": "", "phase": "", "layer": label,
                 "code": "", "rank": dist.get_rank()}
        with state.lock:
            seq, state.seq = state.seq, state.seq + 1
            _exchange(state, seq, entry)


def _exchange(state: _GroupState, seq: int, entry: dict) -> None:
    store, me = _store(), dist.get_rank()
    prefix = f"{_PREFIX}/{_epoch}/{state.name}"
    abort = f"{_PREFIX}/{_epoch}/abort"
    store.set(f"{prefix}/{seq}/{me}", json.dumps(entry))
    keys = [f"{prefix}/{seq}/{r}" for r in state.ranks]
    deadline, pause = time.monotonic() + _timeout_s, 0.0002
    while not store.check(keys):
        if store.check([abort]):
            raise ScheduleMismatch(store.get(abort).decode())
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(state.ranks, keys) if not store.check([k])]
            message = (f"bigdense collective schedule check: collective #{seq} on {_group_label(state)}: "
                       f"rank(s) {missing} did not reach it within {_timeout_s:g} s while rank {me} issues "
                       f"{_describe(entry)} (they skipped it, or are stuck before it)")
            store.set(abort, message)
            raise ScheduleMismatch(message)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    entries = [json.loads(store.get(k)) for k in keys]
    if any(tuple(e[f] for f in _COMPARED) != tuple(entries[0][f] for f in _COMPARED) for e in entries):
        lines = "\n".join(f"  rank {e['rank']}: {_describe(e)}" for e in entries)
        message = (f"bigdense collective schedule check: the ranks of {_group_label(state)} disagree at "
                   f"collective #{seq} (every entry before it agreed):\n{lines}")
        store.set(abort, message)
        raise ScheduleMismatch(message)
    if seq:  # every peer has posted `seq`, so it has read this rank's `seq - 1`
        store.delete_key(f"{prefix}/{seq - 1}/{me}")


# ---- boundaries at the end of forward and backward (hooks exist only while the check is on) ----
class _Hooks:
    def __init__(self):
        self.handles = []
        self.local = threading.local()

    def install(self) -> None:
        if not self.handles:
            from torch.nn.modules import module as module_hooks

            # always_call: a forward that raises still leaves the depth count right.
            self.handles = [module_hooks.register_module_forward_pre_hook(self._pre),
                            module_hooks.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # Outermost calls are counted on the training thread only: a checkpointed block re-run inside
    # the backward is not one (and torch stops such a re-run early, by an exception, once it has
    # what the backward needs).
    def _pre(self, module, args) -> None:
        if torch._C._current_autograd_node() is not None:
            return
        depth = getattr(self.local, "depth", 0)
        if depth == 0 and module not in _names:  # (a module already named is part of a larger model)
            _register_names(module)
        self.local.depth = depth + 1

    def _post(self, module, args, out) -> None:
        if torch._C._current_autograd_node() is not None:
            return
        self.local.depth = max(getattr(self.local, "depth", 1) - 1, 0)
        if self.local.depth or sys.exc_info()[1] is not None:
            return  # an inner module, or a forward that raised (the error goes on as it is)
        label = _module_label(module)
        boundary(f"end of the forward of {label}")
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, label=label: _end_of_backward(label))
                break


def _end_of_backward(label: str) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(
        lambda: boundary(f"end of the backward through {label}"))


_hooks = _Hooks()
if env_flag(_ENV, False):
    _set(True, _env_timeout())
else:
    _timeout_s = _env_timeout()
