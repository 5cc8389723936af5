"""What a model and its optimizer state are on disk: boxes of global tensors ("pieces").

`model_pieces` turns a model into boxes of global tensors using the layers' ``bd_shard_specs()``
(parameters no layer reports are replicated over TP); `optimizer_state_piece` does the same for a
per-parameter optimizer tensor, keyed by parameter *name* rather than by the optimizer's
positional index, so the state finds its parameter at any layout and in either kind of optimizer.
`unwrap` finds the plain module inside DDP, ``torch.compile`` and DeepSpeed wrappers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.nn as nn

from ..parallel.sharding import ShardSpec, is_dtensor, local_tensor
from .boxes import narrow_box
from .format import CheckpointError


@dataclass
class Piece:
    """One tensor of this rank: its box in the global tensor, and who writes it.

    ``sharded``: each TP rank holds a different box. Otherwise the tensor is replicated over TP and
    only TP rank 0's copy is written. ``dp_owned``: only this DP rank holds this box (a ZeRO
    partition's fragment, a shard of a tensor split over the whole mesh), so it writes it itself; other pieces are held alike by every DP replica
    of its TP rank and `writers.assign_writes` shares them out among the replicas.

    ``parts``: a packed parameter's tensor is several boxes of its global tensor along
    ``shard_dim`` (`ShardSpec.boxes`: ``(local start, global start, length)``); ``offsets`` then
    place the other dims. `boxes` gives the piece as single-box pieces, which is how it is stored.

    ``within``: where ``tensor`` starts inside this rank's TP-local tensor, which FSDP splits again
    over DP (a DTensor's local slice; `offsets` and `parts` describe the TP-local tensor). Such a
    piece is ``dp_owned``; ``replica`` marks the copies HSDP keeps on its other replicas, which
    the first replica writes.
    """

    key: str  # "model/<name>" or "optim/<param name>/<state key>"
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sharded: bool
    shard_dim: Optional[int] = None
    dp_owned: bool = False
    parts: tuple[tuple[int, int, int], ...] = ()
    split: bool = False  # one of several boxes of its tensor that this rank stores (named with its offsets)
    within: tuple[int, ...] = ()  # this tensor's offsets inside the TP-local tensor (FSDP's DP slice)
    replica: bool = False  # an HSDP replica's copy of a box another DP rank writes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_global(self, local_off, shape) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """``(local offsets, global offsets, shape)`` of the global boxes that the box
        ``local_off``/``shape`` of this piece's tensor covers (several when it crosses packed parts)."""
        within = self.within or (0,) * len(local_off)
        tp_off = tuple(o + w for o, w in zip(local_off, within))  # in the TP-local tensor
        back = lambda off: tuple(o - w for o, w in zip(off, within))  # noqa: E731  (to this tensor's)
        if not self.parts:
            return [(tuple(local_off), tuple(o + g for o, g in zip(tp_off, self.offsets)), tuple(shape))]
        d, out = self.shard_dim, []
        for local_start, global_start, length in self.parts:
            lo, hi = max(tp_off[d], local_start), min(tp_off[d] + shape[d], local_start + length)
            if hi > lo:
                loff, goff, box = list(tp_off), [o + g for o, g in zip(tp_off, self.offsets)], list(shape)
                loff[d], goff[d], box[d] = lo, global_start + lo - local_start, hi - lo
                out.append((back(loff), tuple(goff), tuple(box)))
        return out

    def boxes(self) -> list["Piece"]:
        """This piece as single-box pieces over views of its tensor (itself when it is one already)."""
        if not self.parts and not any(self.within):
            return [self]
        zero = (0,) * self.tensor.dim()
        return [replace(self, tensor=narrow_box(self.tensor, zero, loff, shape), offsets=goff, parts=(), within=(),
                        split=bool(self.parts))
                for loff, goff, shape in self.to_global(zero, self.shape)]

    def like(self, key: str, tensor: torch.Tensor) -> "Piece":
        """A tensor of this piece's local shape (an Adam moment of its parameter), boxed the same way."""
        return replace(self, key=key, tensor=tensor, split=False)


@dataclass
class ModelState:
    pieces: dict[str, Piece]  # by model tensor name
    aliases: dict[str, str]  # tied name -> name it is stored under
    canonical: dict[int, str]  # id(parameter) -> stored name
    non_tensor: dict[str, Any] = field(default_factory=dict)


def unwrap(model) -> tuple[nn.Module, Any]:
    """``(plain module, DeepSpeed engine or None)`` for a module, a DDP wrapper or a DeepSpeedEngine."""
    engine = None
    if type(model).__module__.startswith("deepspeed.") and isinstance(getattr(model, "module", None), nn.Module):
        engine, model = model, model.module
    elif not isinstance(model, nn.Module) and hasattr(model, "checkpoint_state"):
        raise TypeError(
            f"got a bigdense {type(model).__name__}; pass its parts: "
            f"bd.save_checkpoint(path, **engine.checkpoint_state()), likewise bd.load_checkpoint"
        )
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            break
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, a DDP wrapper or a DeepSpeedEngine, got {type(model).__name__}")
    return model, engine


def collect_shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """``{parameter name: ShardSpec}`` for every sharded parameter, from the layers' own reports."""
    from ..layers.base import named_shard_specs

    return named_shard_specs(module)


def _box_of(name: str, tensor: torch.Tensor, spec: Optional[ShardSpec], tp_rank: int, tp_size: int):
    """``(global shape, offsets, parts)`` of a model tensor (see `Piece`)."""
    if spec is None:
        return tuple(tensor.shape), (0,) * tensor.dim(), ()
    if spec.group == "tp" and (len(spec.sizes) != tp_size or spec.rank != tp_rank):
        raise CheckpointError(
            f"parameter {name!r} is sharded over a TP group of {len(spec.sizes)} ranks (rank {spec.rank}), "
            f"but the parallel context has tp={tp_size} (rank {tp_rank}); build layers after bd.init_parallel"
        )
    if tuple(tensor.shape) != spec.local_shape:
        raise CheckpointError(
            f"parameter {name!r} has local shape {tuple(tensor.shape)}, but its layer reports {spec.local_shape}"
        )
    offsets = [0] * tensor.dim()
    if spec.parts == 1:
        offsets[spec.dim] = spec.start
        return spec.global_shape, tuple(offsets), ()
    return spec.global_shape, tuple(offsets), tuple(spec.boxes())


def model_pieces(module: nn.Module, tp_rank: int, tp_size: int) -> ModelState:
    """This rank's model tensors (parameters and persistent buffers) as boxes of global tensors."""
    specs = collect_shard_specs(module)
    pieces, aliases, canonical, non_tensor = {}, {}, {}, {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            non_tensor[name] = value  # a module's get_extra_state()
            continue
        if id(value) in canonical:  # tied weights: stored once
            aliases[name] = canonical[id(value)]
            continue
        canonical[id(value)] = name
        spec = specs.get(name)
        global_shape, offsets, parts = _box_of(name, value, spec, tp_rank, tp_size)
        # A tensor split over the whole mesh (shard spec group "world") has no DP replicas: each rank writes its box.
        piece = Piece(f"model/{name}", value.detach(), tuple(global_shape), offsets, spec is not None,
                      None if spec is None else spec.dim, dp_owned=spec is not None and spec.group == "world",
                      parts=parts)
        pieces[name] = _dp_slice(piece) if is_dtensor(value) else piece
    return ModelState(pieces, aliases, canonical, non_tensor)


def _dp_slice(piece: Piece) -> Piece:
    """A piece of an FSDP-sharded tensor (a DTensor over the DP mesh): its local slice, placed
    inside the TP-local tensor, written by this DP rank (the first HSDP replica)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    value = piece.tensor
    local = local_tensor(value)
    shape, within = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(local.shape):
        raise CheckpointError(f"{piece.key}: the DP-sharded tensor's local shape {tuple(local.shape)} is not its "
                              f"placements' {tuple(shape)}")
    coordinate = value.device_mesh.get_coordinate()
    replica = any(c != 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))
    return replace(piece, tensor=local, within=tuple(within), dp_owned=True, replica=replica)


def param_name(model: ModelState, param: torch.Tensor, where: str) -> str:
    name = model.canonical.get(id(param))
    if name is None:
        raise CheckpointError(
            f"{where} holds a parameter of shape {tuple(param.shape)} that is not in the model's state_dict"
        )
    return name


def optimizer_state_piece(model: ModelState, name: str, key: str, value: torch.Tensor) -> Piece:
    """A per-parameter optimizer tensor as a box: shaped like the parameter -> sharded like it."""
    param_piece = model.pieces.get(name)
    if param_piece is None:  # only a model with adapters leaves parameters out (`lora_state.trainable_state`)
        raise CheckpointError(
            f"the optimizer holds state {key!r} of {name!r}, a frozen parameter of a model with adapters, which its "
            f"checkpoint does not store; build the optimizer over the trainable parameters (requires_grad) only"
        )
    value = local_tensor(value)  # an FSDP-sharded parameter's state is sharded like it
    if value.dim() > 0 and tuple(value.shape) == param_piece.shape:
        return param_piece.like(f"optim/{name}/{key}", value.detach())
    if param_piece.sharded and value.dim() > 0:
        raise CheckpointError(
            f"optimizer state {key!r} of sharded parameter {name!r} has shape {tuple(value.shape)}, neither the "
            f"parameter's {param_piece.shape} nor a scalar; bigdense cannot tell how it is sharded"
        )
    return Piece(f"optim/{name}/{key}", value.detach(), tuple(value.shape), (0,) * value.dim(), False)


def current_context():
    """The default parallel context, checked against torch.distributed's world."""
    from ..parallel.context import get_default_context
    from ._agree import world_size

    ctx = get_default_context()
    if ctx.world_size != world_size():
        raise CheckpointError(
            f"torch.distributed has {world_size()} ranks but the bigdense context has {ctx.world_size}; "
            f"call bd.init_parallel(tp=...) before saving or loading"
        )
    return ctx
