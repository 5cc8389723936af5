"""Raw collectives over a tensor-parallel group, with no autograd; and the count of them.

Convention used throughout bigdense: ``group=None`` means *no parallelism* (a group of one rank,
no process group needed), never "the default world group". Every function here is then a cheap
no-op, which is what lets the same layer code run in a plain single process.

Uneven shards: gloo's ``all_gather`` refuses tensors of different sizes and NCCL's needs a list of
outputs, so `all_gather_dim` pads every shard to the largest one, uses the single-tensor
gather that both backends have (``all_gather_single``), and trims; `reduce_scatter_dim` pads each
rank's chunk the same way before the single-tensor reduce-scatter. One code path for both
backends means the CPU tests exercise exactly what runs on GPUs.

Asynchronous forms (``*_start``) issue the collective and return a `Pending` whose ``wait()``
finishes it (trimming the padding) and returns the result; layers use them to run a GEMM while a
collective is in flight. Every collective of bigdense goes through `_issue` here, which is what
`count_collectives` sees and where the collective-schedule check (`bigdense.parallel.schedule`)
makes the ranks agree on each collective before it is issued.

Inside ``torch.compile`` (`traceable`), the same functions issue PyTorch's functional collectives
(``torch.distributed._functional_collectives``), which dynamo and AOTAutograd trace into the graph
without a break (and which the compiler schedules; they are not counted); eager calls are unchanged.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import schedule

ProcessGroup = dist.ProcessGroup

# torch 2.13 renamed the single-tensor collectives (the old names warn); older releases lack the new ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FUNCOL_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def traceable() -> bool:
    """Whether collectives must be the functional ones: we are being traced by torch.compile."""
    return torch.compiler.is_compiling()


# ---- counting ----
@dataclass
class CollectiveCounts:
    """What `count_collectives` recorded on this rank.

    ``by_kind``: ``{kind: (calls, bytes)}``, kinds ``"all_reduce"``, ``"all_gather"``,
    ``"reduce_scatter"``, ``"broadcast"``, ``"all_to_all"``; bytes are those handed to the backend (the
    full tensor of an all-reduce, the gathered output of an all-gather, the input of a
    reduce-scatter, padded when shards are uneven; what an all-to-all sends to the other ranks). ``events``: in order, ``("issue", kind, bytes)`` when a collective is
    launched and ``("wait", kind, bytes)`` when its result is taken; other code may append its own
    entries to the same list to interleave them (the overlap test logs GEMMs there).
    """

    by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)
    events: list = field(default_factory=list)

    def calls(self, kind: str) -> int:
        return self.by_kind.get(kind, (0, 0))[0]

    def bytes(self, kind: str) -> int:
        return self.by_kind.get(kind, (0, 0))[1]


# A process-wide stack, not thread-local: the autograd engine may run a backward on its own thread.
_counters: list[CollectiveCounts] = []


@contextlib.contextmanager
def count_collectives():
    """``with bd.count_collectives() as counts:`` records every collective bigdense issues inside."""
    counts = CollectiveCounts()
    _counters.append(counts)
    try:
        yield counts
    finally:
        _counters.remove(counts)


def _record(phase: str, kind: str, nbytes: int) -> None:
    for counts in _counters:
        counts.events.append((phase, kind, nbytes))
        if phase == "issue":
            calls, total = counts.by_kind.get(kind, (0, 0))
            counts.by_kind[kind] = (calls + 1, total + nbytes)


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and returns its result.

    ``kind`` and ``group`` also name the collective when ``wait()`` fails: the backend raises from
    C++, so the traceback has no torch.distributed frame (`bigdense.train.faults` reads them)."""

    def __init__(self, work, kind: Optional[str], nbytes: int, finish: Callable[[], torch.Tensor],
                 group: Optional[ProcessGroup] = None):
        self._work, self._nbytes, self._finish = work, nbytes, finish
        self.kind, self.group = kind, group

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        if self.kind is not None:
            _record("wait", self.kind, self._nbytes)
        return self._finish()


def _issue(kind: str, group: Optional[ProcessGroup], buffer: torch.Tensor, launch, traced,
           finish: Callable[[], torch.Tensor], op=None, nbytes: Optional[int] = None) -> Pending:
    """Launch a collective on ``buffer`` (what the backend is handed; its bytes are counted):
    ``launch()`` (eager, asynchronous, returns the backend's work) or, under torch.compile,
    ``traced()`` (the functional collective, done when it returns). With the collective-schedule
    check on, the ranks first agree on it (`bigdense.parallel.schedule`)."""
    if traceable():
        traced()
        return completed(finish())
    if schedule.enabled():
        schedule.agree(kind, group, buffer, None if op is None else _FUNCOL_OPS.get(op, str(op)))
    nbytes = _nbytes(buffer) if nbytes is None else nbytes
    _record("issue", kind, nbytes)
    return Pending(launch(), kind, nbytes, finish, group)


def completed(result: torch.Tensor) -> Pending:
    """A `Pending` for a result already there (a one-rank group, a finished collective): records nothing."""
    return Pending(None, None, 0, lambda: result)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- groups ----
def group_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---- collectives ----
def all_reduce_start(tensor: torch.Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM) -> Pending:
    """Issue an in-place all-reduce of ``tensor``; ``wait()`` returns ``tensor``."""
    if group_size(group) == 1:
        return completed(tensor)
    return _issue("all_reduce", group, tensor,
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
                  lambda: tensor.copy_(funcol.all_reduce(tensor, _FUNCOL_OPS[op], group)), lambda: tensor, op)


def all_reduce_(tensor: torch.Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    return all_reduce_start(tensor, group, op).wait()


def all_gather_sizes(length: int, group: Optional[ProcessGroup], device) -> list[int]:
    """Every rank's ``length``, in rank order (one tiny collective)."""
    if group_size(group) == 1:
        return [int(length)]
    # torch.full, not torch.tensor: under Dynamo a torch.tensor of a Python int is a constant, whose
    # propagation runs the functional all-gather for real while tracing and never waits for it.
    mine = torch.full((1,), int(length), dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    _issue("all_gather", group, out, lambda: _all_gather_single(out, mine, group=group, async_op=True),
           lambda: out.copy_(funcol.all_gather_tensor(mine, 0, group)), lambda: out).wait()
    return [int(v) for v in out.tolist()]


def _checked_sizes(tensor, dim, group, sizes, what) -> list[int]:
    sizes = [int(s) for s in sizes]
    rank = group_rank(group)
    if tensor.shape[dim] != sizes[rank]:
        raise RuntimeError(f"{what}: rank {rank} holds {tensor.shape[dim]} along dim {dim}, expected {sizes[rank]}")
    return sizes


def _pad_front(front: torch.Tensor, length: int) -> torch.Tensor:
    if front.shape[0] < length:
        pad = front.new_zeros((length - front.shape[0],) + tuple(front.shape[1:]))
        front = torch.cat([front, pad], dim=0)
    return front.contiguous()


def all_gather_dim_start(
    tensor: torch.Tensor, dim: int, group: Optional[ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> Pending:
    """Issue `all_gather_dim`; ``wait()`` returns the concatenation."""
    world = group_size(group)
    if world == 1:
        return completed(tensor)
    dim = dim % tensor.dim()
    if sizes is None:
        sizes = all_gather_sizes(tensor.shape[dim], group, tensor.device)
    sizes = _checked_sizes(tensor, dim, group, sizes, "all_gather_dim")
    longest = max(sizes)
    # The single-tensor all-gather concatenates along dim 0, so gather with `dim` moved to the front.
    front = _pad_front(tensor.movedim(dim, 0), longest)
    out = front.new_empty((world * longest,) + tuple(front.shape[1:]))

    def finish() -> torch.Tensor:
        if all(s == longest for s in sizes):
            full = out
        else:
            full = torch.cat([out[r * longest : r * longest + s] for r, s in enumerate(sizes)], dim=0)
        return full.movedim(0, dim).contiguous()

    return _issue("all_gather", group, out,
                  lambda: _all_gather_single(out, front, group=group, async_op=True),
                  lambda: out.copy_(funcol.all_gather_tensor(front, 0, group)), finish)


def all_gather_dim(
    tensor: torch.Tensor,
    dim: int,
    group: Optional[ProcessGroup],
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``; shards may differ in length along ``dim``.

    ``sizes`` (each rank's length along ``dim``, in rank order) avoids a round of size exchange;
    when omitted it is gathered.
    """
    return all_gather_dim_start(tensor, dim, group, sizes).wait()


def reduce_scatter_dim_start(
    tensor: torch.Tensor, dim: int, group: Optional[ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> Pending:
    """Issue `reduce_scatter_dim`; ``wait()`` returns this rank's summed slice."""
    world = group_size(group)
    if world == 1:
        return completed(tensor)
    dim = dim % tensor.dim()
    sizes = _balanced_or(sizes, tensor.shape[dim], world, dim)
    longest = max(sizes)
    front = tensor.movedim(dim, 0)
    if any(s != longest for s in sizes):  # every rank's chunk padded to the longest one
        starts = [sum(sizes[:r]) for r in range(world)]
        front = torch.cat([_pad_front(front[a : a + s], longest) for a, s in zip(starts, sizes)], dim=0)
    front = front.contiguous()
    out = front.new_empty((longest,) + tuple(front.shape[1:]))
    mine = sizes[group_rank(group)]
    return _issue("reduce_scatter", group, front,
                  lambda: _reduce_scatter_single(out, front, group=group, async_op=True),
                  lambda: out.copy_(funcol.reduce_scatter_tensor(front, "sum", 0, group)),
                  lambda: out[:mine].movedim(0, dim).clone(memory_format=torch.contiguous_format))


def reduce_scatter_dim(
    tensor: torch.Tensor, dim: int, group: Optional[ProcessGroup], sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's slice along ``dim`` (balanced split unless
    ``sizes`` is given; uneven allowed). Every rank passes a tensor of the same shape."""
    return reduce_scatter_dim_start(tensor, dim, group, sizes).wait()


def _balanced_or(sizes, total: int, world: int, dim: int) -> list[int]:
    from .sharding import shard_sizes

    if sizes is None:
        return shard_sizes(total, world)
    sizes = [int(s) for s in sizes]
    if sum(sizes) != total or len(sizes) != world:
        raise RuntimeError(f"sizes {sizes} do not split {total} along dim {dim} over {world} ranks")
    return sizes


def split_dim(
    tensor: torch.Tensor,
    dim: int,
    group: Optional[ProcessGroup],
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``dim`` (balanced split unless ``sizes`` is given)."""
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    sizes = _balanced_or(sizes, tensor.shape[dim], world, dim)
    rank = group_rank(group)
    # A copy, even where the slice is already contiguous: a view would keep the whole tensor alive.
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone(memory_format=torch.contiguous_format)


def broadcast_(tensor: torch.Tensor, src_group_rank: int, group: Optional[ProcessGroup]) -> torch.Tensor:
    """In-place broadcast from the rank with ``src_group_rank`` inside ``group``."""
    if group_size(group) == 1:
        return tensor
    src = dist.get_global_rank(group, src_group_rank)
    return _issue("broadcast", group, tensor,
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
                  lambda: tensor.copy_(funcol.broadcast(tensor, src, group)), lambda: tensor).wait()


def all_to_all_start(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                     input_splits: Sequence[int], group: Optional[ProcessGroup]) -> Pending:
    """Issue an all-to-all of flat tensors: ``input_splits[r]`` elements of ``input`` (in rank order)
    go to rank ``r`` of ``group``, ``output_splits[r]`` come from it into ``output``; ``wait()``
    returns ``output``. Uneven splits work on gloo and NCCL alike. Counted bytes: those sent to the
    other ranks (a rank's own split is a local copy)."""
    if group_size(group) == 1:
        return completed(output.copy_(input))
    me = group_rank(group)
    sent = (sum(input_splits) - input_splits[me]) * input.element_size()
    out_splits, in_splits = [int(n) for n in output_splits], [int(n) for n in input_splits]
    return _issue("all_to_all", group, torch.empty(len(in_splits), device="meta"),
                  lambda: dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=True),
                  lambda: output.copy_(funcol.all_to_all_single(input, out_splits, in_splits, group)),
                  lambda: output, nbytes=sent)
