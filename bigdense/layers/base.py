"""What every tensor-parallel layer shares: its group, its shard layout, its seeds, its input checks.

A layer declares, per parameter, the global shape and the dimension it is split along
(``_shards``): the one decision of whether and how a parameter is sharded. From it come
``bd_shard_specs()`` (read by checkpoints, export and parameter counts), the spec attached to each
parameter (`bigdense.parallel.sharding.shard_spec_of`, read by clipping and metrics), the
Megatron-style attributes DeepSpeed reads, and ``gather_param``.
"""
from __future__ import annotations

import math

from typing import Optional

import torch
import torch.nn as nn

from ..host_checks import checks_enabled
from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.dropout import tp_dropout
from ..parallel.random import draw_seed
from ..parallel.regions import SEQ_DIM
from ..parallel.sharding import ShardSpec, mark_sharded, shard_sizes


class TensorParallelModule(nn.Module):
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
        """The full global tensor of parameter ``name`` on every rank (a collective when sharded)."""
        param = getattr(self, name).detach()
        spec = self.shard_spec(name)
        if spec is None:
            return param.clone()
        local = [n * spec.parts for n in spec.sizes]
        gathered = comm.all_gather_dim(param, spec.dim, self.tp_group, local)
        return gathered if spec.parts == 1 else spec.assemble(list(gathered.split(local, spec.dim)))

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


def check_from_dense(cls, module: nn.Module, expected: type, kwargs: dict, from_module: tuple[str, ...]) -> None:
    """The checks every ``from_dense`` makes: ``module`` is an ``expected``, and no keyword in
    ``from_module`` is passed (those options come from the dense module itself)."""
    if not isinstance(module, expected):
        raise TypeError(f"{cls.__name__}.from_dense: expected an nn.{expected.__name__}, got {type(module).__name__}")
    for key in from_module:
        if key in kwargs:
            raise TypeError(f"{cls.__name__}.from_dense: {key}= comes from the nn.{expected.__name__}, do not pass it")


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


def global_numel(module: nn.Module) -> int:
    """Parameters of ``module`` as if unsharded: each sharded one by its global shape, a tied one once."""
    specs, seen, total = named_shard_specs(module), set(), 0
    for name, p in module.named_parameters():  # a tied parameter is yielded once
        if id(p) not in seen:
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
