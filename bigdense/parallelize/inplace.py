"""Converting a module in place: its parameters split, its own class and forward kept.

Most modules a plan names are not plain ``nn.Linear``/``nn.Embedding`` layers that a bigdense layer
can replace: a mixture-of-experts block whose experts live in 3-D parameters, a per-head norm, an
embedding that scales or normalises what it looks up, a linear layer with a learned logit scale.
Each keeps its instance, its class's forward and its parameter names (so checkpoints export to the
plain model), and gains, by `shard_in_place`:

* its parameters replaced by this rank's slices, each declared once as a `ShardSpec`
  (``bd_shard_specs``), so clipping, metrics, checkpoints, resharding, DeepSpeed and the planner know
  them as they know bigdense's own layers;
* its style's communication around its forward (`ShardedInPlace.forward`: the style's ``enter``,
  the module's own forward with the style's ``parameters`` in place of its own, the style's
  ``leave``), all of it through `bigdense.parallel.regions`.

It does so by giving the instance a subclass of its class that mixes `ShardedInPlace` in first
(made once per class): ``isinstance`` checks, the class name and everything the class defines still
hold.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..layers.lora import column_delta, lora_settings, row_delta
from ..parallel import comm
from ..parallel.sharding import ShardSpec
from .styles import Style, StyleError

_CLASSES: dict[type, type] = {}


class ShardedInPlace(TensorParallelModule):
    """Mixed into a converted module's class by `shard_in_place` (see the module docstring)."""

    bd_style: Optional[Style] = None

    def forward(self, *args, **kwargs):
        style = self.bd_style
        if style is None:
            return super().forward(*args, **kwargs)
        raw = args
        args, kwargs, state = style.enter(self, args, kwargs)
        with _in_place_of_parameters(self, style.parameters(self)):
            output = super().forward(*args, **kwargs)
        if lora_settings(self) is None:
            return style.leave(self, output, state)
        # A low-rank adapter (`bigdense.layers.lora`): a column's from the input as it came, added to
        # this rank's output features; a row's from this rank's input features, after the reduction.
        if style.name == "column":
            return style.leave(self, output + column_delta(self, raw[0]), state)
        return style.leave(self, output, state) + row_delta(self, args[0], self.shard_spec("weight").start)

    def bd_partial_grad_params(self) -> list:
        """Replicated parameters whose gradient is partial over TP (`bigdense.parallel.partial_grads`)."""
        if self.bd_style is None or self.tp_size == 1:
            return []
        return [self.get_parameter(n) for n in self.bd_style.partial_grad_params(self)]

    def _describe_shape(self) -> str:
        return type(self).__bases__[1].__name__

    def extra_repr(self) -> str:
        own = super().extra_repr()
        split = ", ".join(f"{n} dim {d}" + (f" x{k}" if k > 1 else "") for n, (_, d, k) in self._shards.items())
        style = self.bd_style.describe() if self.bd_style is not None else "parameters only"
        return f"{own}{', ' if own else ''}tp={self.tp_size} in place: {style}" + (f"; split {split}" if split else "")


@contextlib.contextmanager
def _in_place_of_parameters(module: nn.Module, values: dict):
    """The module's forward sees ``values`` (dotted names reach its children) in place of those
    parameters: as instance attributes of their owners, which win over ``nn.Module``'s parameter
    lookup; the parameters themselves, and so the state dict, stay."""
    owners = []
    for name, value in values.items():
        path, _, attr = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        object.__setattr__(owner, attr, value)
        owners.append((owner, attr))
    try:
        yield
    finally:
        for owner, attr in owners:
            owner.__dict__.pop(attr, None)


def _sharded_class(cls: type) -> type:
    if issubclass(cls, ShardedInPlace):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (ShardedInPlace, cls), {"__module__": cls.__module__,
                                                                    "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def shard_in_place(module: nn.Module, tp_group, where: str, *, style: Optional[Style] = None,
                   splits: Optional[dict[str, tuple[int, int]]] = None, shared: Optional[dict] = None) -> nn.Module:
    """Convert ``module`` in place: set its ``style`` (communication around its forward), and
    replace each parameter of ``splits`` (``{name: (dim, packed blocks)}``) by this rank's slice.

    ``shared`` maps ``id(parameter before)`` to ``(its replacement, global shape, dim, packed)``
    across one conversion, so a parameter two modules share (tied embeddings) is split once and
    both hold the same slice; splitting it two different ways is refused. Returns ``module``.
    """
    shared = {} if shared is None else shared
    if not isinstance(module, ShardedInPlace):
        module.__class__ = _sharded_class(type(module))
        module.tp_group = tp_group
        module.tp_size, module.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        module._shards = {}
    if style is not None:
        if module.bd_style is not None and module.bd_style != style:
            raise StyleError(f"{where} is named by two styles: {module.bd_style.describe()} and {style.describe()}")
        module.bd_style = style
    for name, (dim, packed) in (splits or {}).items():
        _split_parameter(module, name, dim, packed, shared, where)
    if style is not None:
        style.adapt(module)
    return module


def _split_parameter(module, name: str, dim: int, packed: int, shared: dict, where: str) -> None:
    before = module._parameters.get(name)
    if before is None:
        raise StyleError(f"{where} has no parameter {name!r} to split")
    if id(before) in shared:
        after, shape, *how = shared[id(before)]
        if how != [dim, packed]:
            raise StyleError(f"{where}.{name} is shared with a parameter split along dim {how[0]} x{how[1]}; "
                             f"here it would be dim {dim} x{packed}")
    else:
        shape = tuple(before.shape)
        if before.shape[dim] % packed:
            raise StyleError(f"{where}.{name} {shape}: dim {dim} does not hold {packed} equal packed blocks")
        spec = ShardSpec.balanced(shape, dim, module.tp_size, module.tp_rank, packed)
        with torch.no_grad():
            after = nn.Parameter(spec.slice_of(before.detach()).clone(), requires_grad=before.requires_grad)
        shared[id(before)] = (after, shape, dim, packed)
    module._parameters[name] = after
    module._declare_shard(name, shape, dim, packed)
