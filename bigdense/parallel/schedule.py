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

Only collectives are compared. Module boundaries say where a rank is: each collective carries the
pass it is issued in -- an outermost module forward, or the backward through one, named by its
module and by how many collectives the rank had issued on the group when the pass began -- and the
passes the rank ended since its previous collective there. A module that issues no collective (a
probe, a metric, on one rank only) changes nothing another rank compares. A rank that ends a pass
without a collective its peer issues inside that pass (it skipped the *last* collective of the
pass, or every one) is caught as soon as either side sees the other: the peer waiting for it reads
that this rank ended the pass (each rank notes its pass ends in the store, without waiting), this
rank reads at the pass's end that a peer waits inside it, or its next collective arrives with the
pass among those it ended. A rank that stops for good is named at the deadline, with the passes it
last ended. (Passes are told apart by module and start only: a collective-free call of a module on
one rank only, right before the same module's call that issues collectives, reads as a skip.)

    BIGDENSE_CHECK_SCHEDULE=1 torchrun ... launch/train.py       # the whole run
    with bd.check_schedule():  ...                               # a block (tests, a suspect step)
    bd.check_schedule(True, timeout=10)                          # process-wide, 10 s deadline

Off by default, and then free: `comm` tests one module flag per collective and the region wrappers
one per call; no hook is installed. On, each collective and each pass's end cost a few store
round trips (a debug switch, not for production runs). Collectives traced by ``torch.compile`` are not checked (the
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


# ---- passes: each outermost forward, and the backward through it ----
# A pass is what a rank is inside when it issues a collective, named by its kind, its module and
# how many collectives this rank had issued on the group when it began (its start): the same on
# every rank whose schedules agreed so far. The check never compares a pass with a collective; a
# pass only says where a rank was, and that a peer finished the very pass a collective belongs to
# without issuing it.
class _Pass:
    def __init__(self, kind: str, label: str):
        self.kind, self.label = kind, label
        # (a group first used inside the pass starts it at 0, as it does on every rank)
        self.starts = {name: state.seq for name, state in _groups.items()}

    def on(self, group_name: str) -> dict:
        """The pass as its collectives on ``group_name`` carry it (JSON-ready, compared by value)."""
        return {"kind": self.kind, "label": self.label, "start": self.starts.get(group_name, 0)}


_current: Optional[_Pass] = None  # the pass this rank is in (a forward, or the backward through one)


def _pass_text(item: dict) -> str:
    through = "through" if item["kind"] == "backward" else "of"
    return f"the {item['kind']} {through} {item['label']} (from collective #{item['start']} on)"


# ---- agreement through the store ----
class _GroupState:
    def __init__(self, group):
        self.name = group.group_name
        self.ranks = dist.get_process_group_ranks(group)
        self.seq = 0
        self.ended: list[dict] = []  # passes this rank ended since its last collective here (each once)
        self.lock = threading.Lock()
        # torch's "fake" backend (one process playing one rank: shape-only runs) has no peers to
        # agree with, nor a store that holds anything.
        self.checked = dist.get_backend(group) != "fake"


_groups: dict[str, _GroupState] = {}
_excluded: set[str] = set()  # groups whose collectives run on their own thread (outside passes)
_epoch = 0  # advanced by `reset` (collectively, at teardown): keys of an earlier mesh are never read


def exclude_from_boundaries(group) -> None:
    """``group``'s collectives run on a thread of their own (the background checkpoint writer):
    they are checked, but not as part of the training thread's passes."""
    _excluded.add(group.group_name)


def reset() -> None:
    """Forget every group (on every rank at `bd.destroy_parallel`, whose teardown calls it)."""
    global _epoch, _current
    _groups.clear()
    _groups_of.clear()
    _excluded.clear()
    _current = None
    _epoch += 1


on_teardown(reset)


def _store():
    return dist.distributed_c10d._get_default_store()


def _prefix(state: _GroupState) -> str:
    return f"{_PREFIX}/{_epoch}/{state.name}"


def _abort_key() -> str:
    return f"{_PREFIX}/{_epoch}/abort"


def _group_label(state: _GroupState) -> str:
    ctx = get_default_context()
    for what, group in (("TP", ctx.tp_group), ("DP", ctx.dp_group)):
        if group is not None and group.group_name == state.name:
            return f"the {what} group (global ranks {state.ranks})"
    if len(state.ranks) == dist.get_world_size():
        return f"the world group (global ranks {state.ranks})"
    return f"group {state.name} (global ranks {state.ranks})"


def _describe(entry: dict) -> str:
    op = f" {entry['op']}" if entry.get("op") else ""
    where = (f"outside the model, in {entry['layer']}" if entry["phase"] == "step"
             else f"in the {entry['phase']} of {entry['layer']}")
    text = f"{entry['kind']}{op} of {entry['dtype']} {tuple(entry['shape'])} {where} [{entry['code']}]"
    return text + _since(entry.get("ended", []))


def _since(ended: list[dict]) -> str:
    """Where a rank was between its previous collective on the group and this one: the passes it ended."""
    return f"; before it, it reached the end of {_ends_text(ended)}" if ended else ""


def _ends_text(ended: list[dict]) -> str:
    shown = ", then ".join(_pass_text(p) for p in ended[-3:])
    return f"... {shown}" if len(ended) > 3 else shown


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
    inside = _current if state.name not in _excluded else None
    entry = {"kind": kind, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
             "op": op or "", "phase": phase, "layer": layer, "code": code, "rank": dist.get_rank(),
             "pass": None if inside is None else inside.on(state.name)}
    with state.lock:
        seq, state.seq = state.seq, state.seq + 1
        entry["ended"], state.ended = state.ended, []
        _exchange(state, seq, entry)


def _exchange(state: _GroupState, seq: int, entry: dict) -> None:
    store, me = _store(), dist.get_rank()
    prefix = _prefix(state)
    store.set(f"{prefix}/{seq}/{me}", json.dumps(entry))
    keys = [f"{prefix}/{seq}/{r}" for r in state.ranks]
    deadline, pause = time.monotonic() + _timeout_s, 0.0002
    while not store.check(keys):
        _raise_if_aborted(store)
        finished = _peers_that_finished(store, state, seq, entry)
        if finished:
            lines = [f"  rank {me}: {_describe(entry)}"]
            lines += [f"  rank {r}: no collective: it reached the end of {_pass_text(entry['pass'])} without it"
                      for r in finished]
            _fail(store, f"bigdense collective schedule check: the ranks of {_group_label(state)} disagree at "
                         f"collective #{seq} (every entry before it agreed):\n" + "\n".join(lines))
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(state.ranks, keys) if not store.check([k])]
            where = "".join(_last_seen(store, state, seq, r) for r in missing)
            _fail(store, f"bigdense collective schedule check: collective #{seq} on {_group_label(state)}: "
                         f"rank(s) {missing} did not reach it within {_timeout_s:g} s (they skipped it, or are "
                         f"stuck before it) while rank {me} issues {_describe(entry)}{where}")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    entries = [json.loads(store.get(k)) for k in keys]
    problem = _disagreement(entries)
    if problem:
        _fail(store, f"bigdense collective schedule check: the ranks of {_group_label(state)} disagree at "
                     f"collective #{seq} (every entry before it agreed):\n{problem}")
    if seq:  # every peer has posted `seq`, so it has read this rank's `seq - 1`
        store.delete_key(f"{prefix}/{seq - 1}/{me}")


def _disagreement(entries: list[dict]) -> Optional[str]:
    """The message lines when the ranks' entries for one collective differ: in what they issue, or
    because a rank issues it inside a pass that a peer ended before issuing it."""
    lines = "\n".join(f"  rank {e['rank']}: {_describe(e)}" for e in entries)
    if any(tuple(e[f] for f in _COMPARED) != tuple(entries[0][f] for f in _COMPARED) for e in entries):
        return lines
    for e in entries:
        for peer in entries:
            if _ended_without(peer["ended"], e["pass"], e["ended"]):
                return (f"{lines}\n  rank {peer['rank']} reached the end of {_pass_text(e['pass'])} without this "
                        f"collective, which rank {e['rank']} issues inside it")
    return None


def _ended_without(peer_ended: list[dict], inside: Optional[dict], own_ended: list[dict]) -> bool:
    """Whether a peer that ended ``peer_ended`` finished the pass ``inside`` (where this rank issues a
    collective) without issuing it. Not when this rank ended a pass of the same name itself (a
    module called again after the same collective): then the names do not tell the passes apart."""
    return inside is not None and inside in peer_ended and inside not in own_ended


def _peers_that_finished(store, state: _GroupState, seq: int, entry: dict) -> list[int]:
    """The peers that, having issued ``seq`` collectives, ended the pass this rank issues collective
    ``seq`` in: they will not issue it there."""
    if entry["pass"] is None:
        return []
    found = []
    for r in state.ranks:
        note = _ended_note(store, state, r) if r != entry["rank"] else None
        if note is not None and note["count"] == seq and _ended_without(note["ended"], entry["pass"], entry["ended"]):
            found.append(r)
    return found


def _ended_note(store, state: _GroupState, rank: int) -> Optional[dict]:
    key = f"{_prefix(state)}/ended/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def _last_seen(store, state: _GroupState, seq: int, rank: int) -> str:
    note = _ended_note(store, state, rank)
    if note is None or note["count"] != seq or not note["ended"]:
        return ""
    last = f"issued collective #{seq - 1} last" if seq else "issued none here"
    return f"; rank {rank} {last}, then reached the end of {_ends_text(note['ended'])}"


def _raise_if_aborted(store) -> None:
    if store.check([_abort_key()]):
        raise ScheduleMismatch(store.get(_abort_key()).decode())


def _fail(store, message: str) -> None:
    """Raise `ScheduleMismatch` here, and on every rank waiting anywhere (the shared abort key)."""
    store.set(_abort_key(), message)
    raise ScheduleMismatch(message)


def _open(kind: str, label: str) -> _Pass:
    global _current
    _current = _Pass(kind, label)
    return _current


_groups_of: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _watch_groups(root: nn.Module) -> None:
    """Follow, from before their first collective, the groups ``root``'s layers and the default
    context use: a rank whose first pass skips its only collective on a group notes that pass's
    end there too (a group is otherwise followed from its first collective)."""
    if root not in _groups_of:
        mine = {getattr(sub, "tp_group", None) for sub in root.modules()}
        _groups_of[root] = tuple(g for g in mine if isinstance(g, dist.ProcessGroup))
    ctx = get_default_context()
    for group in (ctx.tp_group, ctx.dp_group, *_groups_of[root]):
        if group is not None and group.group_name not in _groups and dist.get_world_size(group) > 1:
            _groups.setdefault(group.group_name, _GroupState(group))


def _forget(done: _Pass) -> None:
    global _current
    if _current is done:
        _current = None


def _close(done: _Pass) -> None:
    """Note, on every group this rank has used, that it ended pass ``done`` (for peers still inside
    it, and to name where it was); raise if a peer already waits inside ``done`` for a collective
    this rank did not issue there, or if the check has failed elsewhere."""
    _forget(done)
    if not _enabled or not dist.is_initialized():
        return
    store, me = _store(), dist.get_rank()
    for name in sorted(_groups):
        state = _groups[name]
        if name in _excluded or not state.checked:
            continue
        item = done.on(name)
        with state.lock:
            first = item not in state.ended  # (a module run again after the same collective: noted once)
            if first:
                state.ended.append(item)
            store.set(f"{_prefix(state)}/ended/{me}", json.dumps({"count": state.seq, "ended": state.ended}))
            _raise_if_aborted(store)
            waiting = _peer_waiting_inside(store, state, item) if first else None
            if waiting is not None:
                _fail(store, f"bigdense collective schedule check: the ranks of {_group_label(state)} disagree "
                             f"at collective #{state.seq} (every entry before it agreed):\n  rank {waiting['rank']}: "
                             f"{_describe(waiting)}\n  rank {me}: no collective: it reached the end of "
                             f"{_pass_text(item)} without it")


def _peer_waiting_inside(store, state: _GroupState, item: dict) -> Optional[dict]:
    """A peer's entry for this rank's next collective number, when the peer issues it inside pass
    ``item`` (which this rank has just ended without it)."""
    for r in state.ranks:
        key = f"{_prefix(state)}/{state.seq}/{r}"
        if r != dist.get_rank() and store.check([key]):
            entry = json.loads(store.get(key))
            if entry["pass"] == item and item not in entry["ended"]:
                return entry
    return None


# ---- where passes begin and end (hooks exist only while the check is on) ----
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
        if depth == 0:
            if module not in _names:  # (a module already named is part of a larger model)
                _register_names(module)
            if dist.is_initialized():
                _watch_groups(module)
            self.local.forward = _open("forward", _module_label(module))
        self.local.depth = depth + 1

    def _post(self, module, args, out) -> None:
        if torch._C._current_autograd_node() is not None:
            return
        self.local.depth = max(getattr(self.local, "depth", 1) - 1, 0)
        if self.local.depth:
            return  # an inner module
        done = getattr(self.local, "forward", None)
        if done is None:
            return
        if sys.exc_info()[1] is not None:
            _forget(done)
            return  # a forward that raised (the error goes on as it is)
        _close(done)
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, label=done.label: _begin_backward(label))
                break


def _begin_backward(label: str) -> None:
    """The gradient of an outermost forward's output is there: the backward through it has begun
    (unless another output's began this backward already). Its end is noted when autograd finishes."""
    if _current is not None and _current.kind == "backward":
        return
    started = _open("backward", label)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _close(started))


_hooks = _Hooks()
if env_flag(_ENV, False):
    _set(True, _env_timeout())
else:
    _timeout_s = _env_timeout()
