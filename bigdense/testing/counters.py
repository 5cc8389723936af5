"""Proxies on CPU for what a GPU step costs: kernels launched, host synchronisations, and the bytes
DeepSpeed's own collectives move (`count_deepspeed_bytes`).

``OpCounter`` is a TorchDispatchMode: every aten op that reaches the dispatcher is one kernel
launch on a GPU (minus views, which launch nothing and are counted apart), and the ops that make
the host wait for the device are counted as syncs: reading a value (``item``/``float``/``bool``,
i.e. ``aten._local_scalar_dense``), ``nonzero`` and the ops built on it (boolean-mask indexing,
``masked_select``, ``unique``), ``equal``, and ``Tensor.tolist`` (which reads memory without an
aten op, so it is counted by patching it for the duration).
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNC_OPS = {
    aten._local_scalar_dense, aten.nonzero, aten.equal, aten.masked_select, aten._unique2,
    aten.unique_dim, aten.unique_consecutive, aten.is_nonzero,
}


def _is_sync(func, args) -> bool:
    if func.overloadpacket in _SYNC_OPS:
        return True
    if func.overloadpacket is aten.index and len(args) > 1:  # x[mask]: a nonzero inside
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class OpCounter(TorchDispatchMode):
    """Counts aten ops (``ops``: non-view ops; ``views``), and host syncs (``syncs``, with
    ``sync_ops`` naming them). Use as a context manager around the code to measure."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.views = 0
        self.syncs = 0
        self.by_op: collections.Counter = collections.Counter()
        self.sync_ops: collections.Counter = collections.Counter()
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.view_copy in func.tags or func.is_view:
            self.views += 1
        else:
            self.ops += 1
            self.by_op[str(func.overloadpacket)] += 1
        if _is_sync(func, args):
            self._sync(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def _sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_ops[name] += 1

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        original, counter = self._tolist, self

        def tolist(tensor):
            counter._sync("Tensor.tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


_DEEPSPEED_KINDS = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor",
                    "all_gather", "broadcast", "all_reduce_coalesced")


@contextlib.contextmanager
def count_deepspeed_bytes():
    """``{kind: bytes}`` that DeepSpeed's own collectives (``deepspeed.comm``) hand the backend
    inside the block: the first tensor of each call (the buffer reduced, gathered or broadcast).
    bigdense's collectives go to torch.distributed directly and are not counted (that is
    `bigdense.count_collectives`)."""
    from deepspeed.comm import comm as ds_comm

    if ds_comm.cdb is None:  # DeepSpeed's backend object, made at its first initialize: made now to patch it
        ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    counts, backend = {}, ds_comm.cdb
    originals = {kind: getattr(backend, kind) for kind in _DEEPSPEED_KINDS if hasattr(backend, kind)}

    def counting(kind, fn):
        def call(*args, **kwargs):
            values = list(args) + list(kwargs.values())
            tensors = [a for a in values if torch.is_tensor(a)]
            tensors += [t for a in values if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
            counts[kind] = counts.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors[:1])
            return fn(*args, **kwargs)
        return call

    for kind, fn in originals.items():
        setattr(backend, kind, counting(kind, fn))
    try:
        yield counts
    finally:
        for kind, fn in originals.items():
            setattr(backend, kind, fn)


# c10d's operators (``torch.ops.c10d.*``) -> the collective's name.
_C10D_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "barrier": "barrier",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _origin(frame) -> str:
    """Who issued the collective: the innermost Python frame that is bigdense's collective layer
    (``bigdense/parallel/comm.py``), FSDP (``torch/distributed/fsdp``) or DDP's Python side
    (``torch/nn/parallel/distributed.py``); ``"other"`` when none is on the stack: a direct
    ``torch.distributed`` call from elsewhere, or a C++ caller such as DDP's reducer, whose bucket
    all-reduces start from autograd hooks during ``backward``."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("bigdense/parallel/comm.py"):
            return "bigdense"
        if "/torch/distributed/fsdp/" in path:
            return "fsdp"
        if path.endswith("torch/nn/parallel/distributed.py"):
            return "ddp"
        frame = frame.f_back
    return "other"


class CollectiveCounter(TorchDispatchMode):
    """Every collective that reaches a c10d process group inside the block, whoever issued it.

    A collective is an operator of the ``c10d`` namespace (``c10d::allreduce_``,
    ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ...), which every
    ``torch.distributed`` call and every C++ caller of ``ProcessGroup`` goes through (DDP's reducer
    included: its bucket all-reduces are seen here, from the autograd thread, which carries the
    mode). One record per call, ``(kind, group, origin, nbytes)``:

    - ``kind``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ... (coalesced and
      ``_base`` forms folded into their collective; anything else keeps its operator name);
    - ``group``: the name ``groups`` gives the process group (matched by member ranks), ``"world"``
      for all ranks, else the group's ranks as a string;
    - ``origin``: ``"bigdense"`` (its collective layer, what `bigdense.count_collectives` counts),
      ``"fsdp"``, ``"ddp"`` (DDP's Python side) or ``"other"`` (anyone else; DDP's reducer, which has
      no Python caller, is one);
    - ``nbytes``: the largest buffer the call names, i.e. the full size of the collective: what an
      all-reduce reduces, what an all-gather produces (group size x the input), what a
      reduce-scatter consumes (group size x the output) -- NCCL-tests' "size". What the backend
      puts on the wire depends on its algorithm (gloo's reduce-scatter is an all-reduce of the
      whole input, a ring all-reduce sends about twice its size) and is not counted.

    Calls made on other threads than the one that entered the mode (and autograd's) are not seen.
    """

    def __init__(self, groups: dict | None = None):
        super().__init__()
        import torch.distributed as dist

        self.records: list[tuple[str, str, str, int]] = []
        self._labels: dict[tuple, str] = {}
        for name, group in (groups or {}).items():
            if group is not None:
                self._labels.setdefault(tuple(dist.get_process_group_ranks(group)), name)
        if dist.is_initialized():
            self._labels.setdefault(tuple(range(dist.get_world_size())), "world")
        self._by_name: dict[str, str] = {}

    def _group(self, value) -> str:
        import torch.distributed as dist

        try:
            pg = dist.ProcessGroup.unbox(value) if isinstance(value, torch.ScriptObject) else value
            name = pg.group_name
        except Exception:  # noqa: BLE001 - not a process group
            return "?"
        if name not in self._by_name:
            try:
                ranks = tuple(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001 - a group torch.distributed does not know by object
                ranks = None
            self._by_name[name] = self._labels.get(ranks, str(list(ranks)) if ranks is not None else name)
        return self._by_name[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            import sys

            values = list(args) + list(kwargs.values())
            groups = [v for v in values if isinstance(v, torch.ScriptObject)]
            name = func.overloadpacket.__name__
            self.records.append((_C10D_KINDS.get(name, name), self._group(groups[0]) if groups else "?",
                                 _origin(sys._getframe(1)), max((_tensor_bytes(v) for v in values), default=0)))
        return func(*args, **kwargs)

    def _select(self, kind=None, group=None, origin=None):
        return [r for r in self.records
                if (kind is None or r[0] == kind) and (group is None or r[1] == group) and (origin is None or r[2] == origin)]

    def calls(self, kind=None, group=None, origin=None) -> int:
        """How many collectives matched (``None``: any)."""
        return len(self._select(kind, group, origin))

    def bytes(self, kind=None, group=None, origin=None) -> int:
        """Their bytes (see the class)."""
        return sum(r[3] for r in self._select(kind, group, origin))

    def summary(self) -> dict:
        """``{(kind, group, origin): (calls, bytes)}``."""
        out: dict = {}
        for kind, group, origin, nbytes in self.records:
            calls, total = out.get((kind, group, origin), (0, 0))
            out[kind, group, origin] = (calls + 1, total + nbytes)
        return out
