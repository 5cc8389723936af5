"""The parallel context: which ranks form a tensor-parallel group and which a data-parallel one.

The mesh is ``(dp, tp)`` with TP innermost, so the ranks of a TP group are neighbours (on one node
when ``tp`` <= GPUs per node, where TP's many small collectives belong). Global rank
``r = dp_rank * tp + tp_rank``.

Layers take ``tp_group=`` explicitly. When they are given none they use the default context's
group, which `init_parallel` sets; with no context at all they run unsharded (TP size 1).
"""
from __future__ import annotations

import datetime
import os
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..errors import ConfigError, check_positive_int

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh; validates ``tp * dp == world_size`` with a message a person can act on.

    The one owner of the TP/DP arithmetic: `resolve` fills in the defaults (``tp``: every process,
    ``dp``: the rest) for `init_parallel` and for `bigdense.config.validate` alike.
    """

    tp: int
    dp: int
    world_size: int

    def __post_init__(self):
        for name in ("tp", "dp", "world_size"):
            check_positive_int(f"parallel.{name}", getattr(self, name), ConfigError)
        if self.tp * self.dp != self.world_size:
            raise ConfigError(
                f"parallel.tp ({self.tp}) x parallel.dp ({self.dp}) = {self.tp * self.dp}, "
                f"but the world size is {self.world_size}: "
                + _world_hint(self.tp, self.world_size)
            )


    @classmethod
    def resolve(cls, tp: Optional[int], dp: Optional[int], world_size: int) -> "ParallelDims":
        """The mesh for ``world_size`` processes; ``tp=None`` means all of them, ``dp=None`` the rest."""
        tp = world_size if tp is None else tp
        check_positive_int("parallel.tp", tp, ConfigError)
        if world_size % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide the number of processes ({world_size}); "
                             + _world_hint(tp, world_size))
        return cls(tp, world_size // tp if dp is None else dp, world_size)


def _world_hint(tp: int, world: int) -> str:
    if world == 1:
        return f"no distributed environment was found; launch with `torchrun --nproc_per_node={tp} ...`"
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return f"with {world} processes, tp must be one of {divisors}"


@dataclass(frozen=True)
class ParallelContext:
    """Process groups and device of this rank.

    Under a launcher ``tp_group`` and ``dp_group`` are always real groups (of one rank when that
    dimension has size 1); in a single process both are ``None``, which bigdense reads as "one
    rank", never as the world group.
    """

    dims: ParallelDims
    rank: int
    tp_group: Optional[ProcessGroup]
    dp_group: Optional[ProcessGroup]
    device: torch.device
    mesh: Optional[object] = None  # torch DeviceMesh (dp, tp) when distributed
    timeout: Optional[datetime.timedelta] = None  # the collective deadline init_parallel was given

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.dims.tp

    @property
    def is_distributed(self) -> bool:
        return self.dims.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_default: Optional[ParallelContext] = None
_owns_process_group = False


def single_process_context(device: Union[str, torch.device, None] = None) -> ParallelContext:
    """A 1-rank context: no process group, every layer unsharded."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ParallelContext(ParallelDims(1, 1, 1), 0, None, None, torch.device(device))


def get_default_context() -> ParallelContext:
    """The context set by `init_parallel` (or `set_default_context`); a 1-rank one if none was."""
    return _default if _default is not None else single_process_context()


def set_default_context(ctx: Optional[ParallelContext]) -> None:
    global _default
    _default = ctx


def resolve_tp_group(tp_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The group a layer uses: the one it was given, else the default context's."""
    if tp_group is not None:
        return tp_group
    return _default.tp_group if _default is not None else None


def _in_launcher() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_parallel(
    tp: int = 1,
    *,
    dp: Optional[int] = None,
    dims: Optional[ParallelDims] = None,
    backend: Optional[str] = None,
    timeout: Union[float, datetime.timedelta, None] = None,
) -> ParallelContext:
    """Build the TP x DP mesh for this process and make it the default context.

    Under torchrun (or once ``torch.distributed`` is initialised) it initialises the process group
    if needed -- ``nccl`` on CUDA, ``gloo`` on CPU, unless ``backend`` says otherwise -- and splits
    the world into TP groups of ``tp`` consecutive ranks and DP groups across them. ``dp`` defaults
    to ``world_size // tp``; ``tp * dp`` must equal the world size. ``dims``, a `ParallelDims` a
    launch resolved already (`bigdense.config.validate` returns it), replaces ``tp`` and ``dp``.
    Alone (no launcher) it returns a
    1-rank context whatever ``tp`` says -- the same script runs unsharded in one process -- and
    warns when ``tp`` or ``dp`` asked for more. ``timeout`` (seconds or a timedelta) bounds every collective, so a rank that
    fails cannot leave the others waiting forever.
    """
    global _owns_process_group
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if dims is not None:
        tp, dp = dims.tp, dims.dp
    if not dist.is_initialized() and not _in_launcher():
        if (tp, dp or 1) != (1, 1):
            warnings.warn(
                f"init_parallel(tp={tp}, dp={dp}): no distributed environment, running as one rank "
                f"(tp=1, dp=1); launch with `torchrun --nproc_per_node={tp * (dp or 1)} ...` to shard",
                stacklevel=2,
            )
        ctx = single_process_context()
        set_default_context(ctx)
        return ctx

    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"backend": backend or ("nccl" if use_cuda else "gloo")}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if use_cuda:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        _owns_process_group = True

    if dims is None or dims.world_size != dist.get_world_size():
        dims = ParallelDims.resolve(tp, dp, dist.get_world_size())

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    ctx = ParallelContext(
        dims=dims,
        rank=dist.get_rank(),
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        device=device,
        mesh=mesh,
        timeout=timeout,
    )
    set_default_context(ctx)
    return ctx


def _let_gloo_workers_finish(groups, deadline_s: float = 5.0) -> None:
    """Run one last tiny collective on each gloo group and wait until its worker thread has let go of it.

    Gloo's worker threads free a finished collective (and the tensors it holds) a moment *after*
    ``wait()`` returns. A group that outlives ``destroy_process_group`` -- a DeviceMesh or a layer
    still holds it -- keeps its threads, and one that frees a tensor while the interpreter is shutting
    down aborts the process ("terminate called without an active exception", pytorch#179291).
    Waiting for the worker to release a probe collective, issued after all the program's own, closes
    that window. Every rank calls `destroy_parallel`, so the probe always has its peers; it is bounded
    by the group's timeout like any collective, and the poll after it by ``deadline_s``.
    """
    for group in groups:
        if group is None or dist.get_backend(group) != "gloo":
            continue
        probe = torch.zeros(1)
        dist.all_reduce(probe, group=group)
        deadline = time.monotonic() + deadline_s
        while probe._use_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)


_teardown: list = []


def on_teardown(fn) -> None:
    """Call ``fn()`` at every `destroy_parallel`, before the process group goes away: what must be
    finished or forgotten with the mesh registers itself (a background checkpoint save in flight,
    the collective-schedule check's state), so this module needs to know none of them."""
    if fn not in _teardown:
        _teardown.append(fn)


def destroy_parallel() -> None:
    """Run the teardown hooks (`on_teardown`: e.g. wait for an asynchronous checkpoint save in
    flight), forget the default context and tear down the process group if `init_parallel` created it."""
    global _owns_process_group
    for fn in list(_teardown):
        fn()
    ctx = _default
    set_default_context(None)
    if _owns_process_group and dist.is_initialized():
        _let_gloo_workers_finish([dist.group.WORLD] + ([ctx.tp_group, ctx.dp_group] if ctx else []))
        dist.destroy_process_group()
    _owns_process_group = False
