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
