"""What every tensor-parallel layer shares: its group, its shard layout, its seeds, its input checks.

A layer declares, per parameter, the global shape and the dimension it is split along
(``_shards``): the one decision of whether and how a parameter is sharded. From it come
``bd_shard_specs()`` (read by checkpoints, export and parameter counts), the spec attached to each
parameter (`bigdense.parallel.sharding.shard_spec_of`, read by clipping and metrics), the
Megatron-style attributes DeepSpeed reads, and ``gather_param``.

Every layer, sharded or not, also converts to and from its plain PyTorch twin by one trio,
`DenseTwin` (``from_dense``, ``to_dense``, ``load_dense_``): a layer says what its twin is and how
it is built from one; the copying, gathering and checking are written once, here.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Mapping, Optional

import torch
import torch.nn as nn

from ..host_checks import checks_enabled
from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.dropout import tp_dropout
from ..parallel.random import draw_seed
from ..parallel.regions import SEQ_DIM
from ..parallel.sharding import ShardSpec, mark_sharded, shard_sizes


class DenseTwin:
    """The trio between a bigdense layer and its plain PyTorch twin, with one meaning for every layer:

    * ``Layer.from_dense(plain, **options)``: a layer holding this rank's slice of ``plain`` (same
      device, dtype, train/eval mode and ``requires_grad``); ``options`` are the constructor's
      keyword options that do not come from ``plain`` (``tp_group``, ``gather_output``, ...).
    * ``layer.to_dense()``: the plain twin with the full tensors, on every rank (a collective over the
      layer's group when it is sharded: every rank calls it).
    * ``layer.load_dense_(...)``: this rank's slices of full tensors copied in place; returns the layer.

    Full tensors go by the twin's state-dict names, in the layer's own layout (its shard
    declaration's global shape; the Conv1D layers keep Conv1D's (in, out)). A layer says what its
    twin is (`_dense_twin`, built on the meta device), what it converts from (`_dense_kind`,
    `_check_dense`) and how an empty layer is built for one (`_empty_from_dense`); composite layers
    (`ParallelMLP`, a low-rank pair) get their children's twins in their own.
    """

    _dense_kind: type | tuple = nn.Module  # what from_dense converts

    def _dense_twin(self) -> nn.Module:
        """The plain module this layer stands for, on the meta device: its class and options, no values."""
        raise NotImplementedError(f"{type(self).__name__} has no plain twin")

    @classmethod
    def _empty_from_dense(cls, dense: nn.Module, **options):
        """A layer shaped for ``dense``, on its device and dtype, values not yet set."""
        raise NotImplementedError(f"{cls.__name__}.from_dense")

    @classmethod
    def _check_dense(cls, dense, method: str) -> None:
        """Refuse a plain module of the wrong kind, naming the layer, the method and what came."""
        if not isinstance(dense, cls._dense_kind):
            kinds = cls._dense_kind if isinstance(cls._dense_kind, tuple) else (cls._dense_kind,)
            expected = " or ".join(f"an nn.{k.__name__}" for k in kinds)
            raise TypeError(f"{cls.__name__}.{method}: expected {expected}, got {type(dense).__name__}")

    @classmethod
    def _state_of(cls, dense: nn.Module) -> dict[str, torch.Tensor]:
        """The full tensors of a plain module of `_dense_kind`, by the twin's names."""
        return dense.state_dict()

    def _full_tensor(self, name: str) -> torch.Tensor:
        """This module's own tensor ``name``, whole, in the twin's layout (a copy)."""
        return getattr(self, name).detach().clone()

    def _where(self) -> str:
        return type(self).__name__

    @classmethod
    def from_dense(cls, dense: nn.Module, **options):
        """A layer holding this rank's slice of the plain module ``dense`` (see `DenseTwin`)."""
        cls._check_dense(dense, "from_dense")
        layer = cls._empty_from_dense(dense, **options).load_dense_(dense)
        return copy_flags(dense, layer)

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The plain twin with the full tensors, on every rank (a collective when sharded)."""
        twin = self._dense_twin()
        for slots, is_param in ((twin._parameters, True), (twin._buffers, False)):
            for name, meta in list(slots.items()):
                if meta is not None:
                    slots[name] = self._twin_tensor(name, meta, is_param)
        for name, child in list(twin.named_children()):
            mine = getattr(self, name, None)
            if isinstance(mine, nn.Module):  # a composite's part: its own twin, or itself when plain
                setattr(twin, name, mine.to_dense() if isinstance(mine, DenseTwin) else copy.deepcopy(mine))
        left = [n for n, t in twin.state_dict().items() if t.is_meta]
        if left:
            raise RuntimeError(f"{self._where()}: to_dense left {left} without values (its parts have no plain twin)")
        return twin.train(self.training)

    def _twin_tensor(self, name: str, meta: torch.Tensor, is_param: bool) -> torch.Tensor:
        full = self._full_tensor(name)
        if full.shape != meta.shape:  # a layer whose layout the twin does not share must say so
            raise RuntimeError(f"{self._where()}: full {name} is {tuple(full.shape)}, its plain twin's "
                               f"{tuple(meta.shape)}")
        return nn.Parameter(full, requires_grad=getattr(self, name).requires_grad) if is_param else full

    @torch.no_grad()
    def load_dense_(self, *tensors, **named):
        """Copy this rank's slices of full tensors in place; returns the layer. The tensors: a plain
        module of the kind `from_dense` takes, or a mapping of the twin's state-dict names to full
        tensors, or the tensors themselves, positionally in the twin's state-dict order (``weight,
        bias`` for a linear layer) or by name. ``None`` stands for an absent tensor (no bias)."""
        for key, full in self._dense_tensors(tensors, named).items():
            path, _, name = key.rpartition(".")
            copy_full_(self.get_submodule(path) if path else self, name, full, f"{self._where()}: {key}")
        return self

    def _dense_tensors(self, tensors: tuple, named: dict) -> dict[str, torch.Tensor]:
        """What `load_dense_` was given, as ``{twin's name: full tensor}``, every name present once."""
        names = list(self._dense_twin().state_dict())
        if len(tensors) == 1 and not named and isinstance(tensors[0], (nn.Module, Mapping)):
            source = tensors[0]
            if isinstance(source, nn.Module):
                type(self)._check_dense(source, "load_dense_")
            given = dict(type(self)._state_of(source) if isinstance(source, nn.Module) else source)
        else:
            if len(tensors) > len(names) or set(names[: len(tensors)]) & set(named):
                raise TypeError(f"{self._where()}: load_dense_ takes the full tensors {names}, in that order or by "
                                f"name, got {len(tensors)} positional and {sorted(named)} by name")
            given = {**dict(zip(names, tensors)), **named}
        given = {k: v for k, v in given.items() if v is not None}
        missing, unexpected = [n for n in names if n not in given], [k for k in given if k not in names]
        if missing or unexpected:
            raise ValueError(f"{self._where()}: load_dense_ expects the full tensors {names} (its plain twin's); "
                             f"missing {missing}, unexpected {unexpected}")
        return given


def copy_flags(source: nn.Module, target: nn.Module) -> nn.Module:
    """``target`` in ``source``'s train/eval mode, each parameter frozen where ``source``'s of the same
    name is (a conversion keeps a fine-tuning setup); returns ``target``."""
    frozen = {n for n, p in source.named_parameters() if not p.requires_grad}
    for name, p in target.named_parameters():
        p.requires_grad_(name not in frozen)
    return target.train(source.training)


def copy_full_(owner: nn.Module, name: str, full: torch.Tensor, what: str) -> None:
    """Copy ``owner``'s slice of the full tensor ``full`` into its tensor ``name`` (the whole of it
    when replicated), after checking the global shape; ``what`` names it in errors."""
    target = getattr(owner, name, None)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{what}: {type(owner).__name__} holds no tensor {name!r} to load (a part replaced by "
                        f"another module has no slice of the plain twin)")
    spec = owner.shard_spec(name) if isinstance(owner, TensorParallelModule) else None
    expected = spec.global_shape if spec is not None else tuple(target.shape)
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != expected:
        got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
        raise ValueError(f"{what}: expected a full tensor of shape {expected}, got {got}")
    target.copy_(full if spec is None else spec.slice_of(full))


def gather_shards(local: torch.Tensor, spec: ShardSpec, group, dim: Optional[int] = None) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's slice, split as ``spec`` says, along ``dim``
    (``spec.dim`` by default: another dim for an activation split like a weight), on every rank of
    ``group`` (a collective)."""
    dim = spec.dim if dim is None else dim
    local_sizes = [n * spec.parts for n in spec.sizes]
    gathered = comm.all_gather_dim(local, dim, group, local_sizes)
    if spec.parts == 1:
        return gathered
    return replace(spec, dim=dim % local.dim()).assemble(list(gathered.split(local_sizes, dim)))


class TensorParallelModule(DenseTwin, nn.Module):
    """Base of bigdense's sharded layers. Subclasses call `_setup_tp` first in ``__init__``."""

    def _setup_tp(self, tp_group) -> None:
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = comm.group_size(self.tp_group)
        self.tp_rank = comm.group_rank(self.tp_group)
        # Seeds are drawn at construction, so a layer built on the meta device and materialised
        # later (`bigdense.materialize`) gets exactly the values an eager build would have.
        self._weight_seed = draw_seed()
        self._shards: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name -> (global shape, dim, packed)

    def _declare_shard(self, name: str, global_shape, dim: int, packed: int = 1) -> None:
        """Parameter ``name`` is this rank's balanced slice of ``global_shape`` along ``dim`` (of
        each of its ``packed`` blocks along ``dim``: see `ShardSpec`)."""
        self._shards[name] = (tuple(int(s) for s in global_shape), dim, packed)
        mark_sharded(getattr(self, name), self.shard_spec(name))

    def _apply(self, fn, recurse=True):
        # .to()/.to_empty() may replace Parameter objects; keep the spec and Megatron attributes on the new ones.
        out = super()._apply(fn, recurse)
        for name in self._shards:
            if getattr(self, name, None) is not None:
                mark_sharded(getattr(self, name), self.shard_spec(name))
        return out

    def shard_spec(self, name: str) -> Optional[ShardSpec]:
        """Where parameter ``name`` sits in its global tensor; ``None`` if it is replicated over TP."""
        if name not in self._shards:
            return None
        shape, dim, packed = self._shards[name]
        return ShardSpec.balanced(shape, dim, self.tp_size, self.tp_rank, packed)

    def bd_shard_specs(self) -> dict[str, ShardSpec]:
        """``{parameter name: ShardSpec}`` for this module's own sharded parameters."""
        return {name: self.shard_spec(name) for name in self._shards if getattr(self, name, None) is not None}

    def gather_param(self, name: str) -> torch.Tensor:
        """The full global tensor of parameter (or buffer) ``name`` on every rank, a new tensor (a
        collective when sharded)."""
        param = getattr(self, name).detach()
        spec = self.shard_spec(name)
        if spec is None or self.tp_size == 1:  # (a group of one would hand back the tensor itself)
            return param.clone()
        return gather_shards(param, spec, self.tp_group)

    def _full_tensor(self, name: str) -> torch.Tensor:
        return self.gather_param(name)

    # ---- input validation: errors name the layer, what was expected and what came ----
    def _where(self) -> str:
        return f"{type(self).__name__}({self._describe_shape()}, tp={self.tp_size}, rank {self.tp_rank})"

    def _describe_shape(self) -> str:
        return ""

    def _check_input(self, x: torch.Tensor, width: int, what: str, param: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._where()}: expected a tensor input, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != width:
            raise ValueError(f"{self._where()}: expected input of shape (*, {width}) ({what}), got {tuple(x.shape)}")
        if x.device != param.device:
            raise ValueError(
                f"{self._where()}: input is on {x.device} but the layer's parameters are on {param.device}"
            )
        if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{self._where()}: input dtype {x.dtype} does not match parameter dtype {param.dtype} "
                f"(cast the input, or run under torch.autocast)"
            )

    def _sequence_shares(self, x: torch.Tensor, seq_len: Optional[int]) -> tuple[int, ...]:
        """Every rank's share of the sequence, for ``x`` (*, S_local, width) under sequence parallelism.

        The shares must be the balanced split of ``seq_len`` (of their sum when ``seq_len`` is None).
        The ranks' lengths are exchanged (one tiny all-gather, read on the host) when ``seq_len`` is
        None, and when host-side checks are on (`bd.set_checks`), so that a wrong shard on any rank
        raises the same error on every rank; otherwise only this rank's own length is checked.
        """
        if x.dim() < 2:
            raise ValueError(
                f"{self._where()}: sequence_parallel=True expects input (*, S_local, {x.shape[-1]}) "
                f"with a sequence dimension, got {tuple(x.shape)}"
            )
        mine = int(x.shape[SEQ_DIM])
        if seq_len is None or (checks_enabled() and self.tp_size > 1):
            every = comm.all_gather_sizes(mine, self.tp_group, x.device)
        else:
            every = None
        total = sum(every) if seq_len is None else int(seq_len)
        expected = shard_sizes(total, self.tp_size)
        if (every is not None and every != expected) or mine != expected[self.tp_rank]:
            got = f"shares {every}" if every is not None else f"{mine} on this rank"
            raise ValueError(
                f"{self._where()}: sequence_parallel=True expects each rank's balanced share of the "
                f"sequence S={total} along dim -2, {expected} in rank order (this rank: "
                f"{(*x.shape[:-2], expected[self.tp_rank], x.shape[-1])}); got {got} "
                f"(this rank's input {tuple(x.shape)})"
            )
        return tuple(expected)


def sequence_dropout(x: torch.Tensor, p: float, training: bool, seq_shares, rank: int) -> torch.Tensor:
    """`tp_dropout` of a replicated ``(*, S, d)`` activation (``seq_shares=None``), or of this rank's
    share of its sequence: the same rows of the same global mask either way."""
    if seq_shares is None:
        return tp_dropout(x, p, training)
    return tp_dropout(x, p, training, shard_dim=SEQ_DIM, global_size=sum(seq_shares), offset=sum(seq_shares[:rank]))


def refuse_options(cls, options: dict, from_module: tuple[str, ...], source: str) -> None:
    """``from_dense`` takes no option in ``from_module``: those come from the plain module, ``source``."""
    for key in from_module:
        if key in options:
            raise TypeError(f"{cls.__name__}.from_dense: {key}= comes from the {source}, do not pass it")


def device_dtype_of(module: nn.Module) -> dict:
    """``device`` and ``dtype`` of a module's first floating-point tensor (none: the defaults)."""
    first = next((t for t in module.state_dict().values() if t.is_floating_point()), None)
    return {} if first is None else {"device": first.device, "dtype": first.dtype}


def named_shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """``{parameter name: ShardSpec}`` for every sharded parameter of ``module``, from its layers' own
    reports (``bd_shard_specs``); parameters no layer reports are replicated."""
    specs = {}
    for prefix, sub in module.named_modules():
        report = getattr(sub, "bd_shard_specs", None)
        if callable(report):
            for name, spec in report().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def global_numel(module: nn.Module, trainable_only: bool = False) -> int:
    """Parameters of ``module`` as if unsharded: each sharded one by its global shape, a tied one
    once; ``trainable_only``: those that require a gradient."""
    specs, seen, total = named_shard_specs(module), set(), 0
    for name, p in module.named_parameters():  # a tied parameter is yielded once
        if id(p) not in seen and (p.requires_grad or not trainable_only):
            seen.add(id(p))
            total += math.prod(specs[name].global_shape) if name in specs else p.numel()
    return total


def allocate_empty(module: nn.Module, device) -> nn.Module:
    """Give a module built with its parameters on the meta device uninitialised storage on
    ``device`` (to be filled by a load). A tied parameter stays one parameter, and each keeps its
    ``requires_grad`` and attributes (shard specs); buffers that hold values (built off the meta
    device, such as rotary frequencies) keep them. (``Module.to_empty`` makes a new parameter per
    module from the meta device, which unties a tied head.)"""
    made: dict[int, torch.Tensor] = {}

    def allocated(tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(tensor) not in made:
            fresh = torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.detach().to(device)
            if is_param:
                fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                fresh.__dict__.update(tensor.__dict__)
            made[id(tensor)] = fresh
        return made[id(tensor)]

    for sub in module.modules():
        for slots, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, tensor in slots.items():
                if tensor is not None:
                    slots[name] = allocated(tensor, is_param)
    return module


def materialize(module: nn.Module, device="cpu") -> nn.Module:
    """Allocate a module built on the meta device and initialise it in place.

    bigdense layers refill from the seeds they drew at construction, so their values equal an eager
    build's after the same ``torch.manual_seed``. Other modules get their own ``reset_parameters()``,
    which draws afresh and uses torch's default law (an ``nn.Embedding`` gets N(0, 1) even if the
    eager code re-initialised it): re-apply custom initialisation of such modules after this.
    """
    module.to_empty(device=device)
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    return module


def replace_module(root: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``name`` in ``root``; returns the root (``new`` when ``name`` is ``""``)."""
    if not name:
        return new
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)
    return root
