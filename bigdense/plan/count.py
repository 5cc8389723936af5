"""Exact parameter counts of a module at any TP size, from its layers' shard declarations or a plan.

Every parameter becomes a `ParamEntry`: its global shape and the dimension TP splits it along
(``None``: replicated on every TP rank). bigdense layers declare theirs (``_shards``, the same
declarations checkpoints read); plain ``nn.Linear``/``nn.Embedding`` modules get theirs from the
plan `bigdense.parallelize` would apply (`tp_plan`), so the count is of the model
``parallelize(model, plan)`` would build. Nothing is allocated: meta-device modules work. A weight
shared by several modules (tied embedding and head) is one entry.

Low-rank adapters (`bigdense.layers.lora`) count as their factors' declarations say, and a frozen
parameter (``requires_grad`` off: the base under adapters) as not trainable. Adapters on the plain
layers of a model not yet converted are split as `attach_lora` splits them on the layer
`parallelize` makes (`adapter_splits`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..layers.lora import LoRAFactor, adapted_kind, attach_lora, lora_settings
from ..models import CausalLM
from ..parallel.sharding import shard_sizes

@dataclass(frozen=True)
class ParamEntry:
    name: str
    global_shape: tuple[int, ...]
    split_dim: Optional[int]  # None: replicated over TP
    trainable: bool = True
    packed: int = 1  # blocks along split_dim, each split on its own (a fused [gate; up] projection)
    # bytes per element when a frozen weight is held narrower than the layout's parameters (a base cast
    # by lora.base_dtype); 0: the layout's width
    held_bytes: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    def local_shape(self, tp: int, rank: int) -> tuple[int, ...]:
        """The shape on TP rank ``rank`` (the balanced split every bigdense layer uses)."""
        shape = list(self.global_shape)
        if self.split_dim is not None:
            shape[self.split_dim] = shard_sizes(shape[self.split_dim] // self.packed, tp)[rank] * self.packed
        return tuple(shape)

    def local_numel(self, tp: int, rank: int) -> int:
        """Elements on TP rank ``rank``."""
        return math.prod(self.local_shape(tp, rank))


def param_entries(model: nn.Module, plan: Optional[Mapping] = None, tp: Optional[int] = None) -> list[ParamEntry]:
    """One entry per distinct parameter of ``model``, with its global shape and TP split.

    ``plan``: a `bigdense.parallelize` plan for the plain layers; ``None`` means the automatic plan
    (a Hugging Face model's own) for a plain model, and the model as built when it already holds
    bigdense layers. ``tp``: the TP size the plan is for (what stays whole can depend on it: heads
    that do not divide); default the current context's.
    """
    from ..parallelize.convert import planned_splits  # how `parallelize` would split each parameter

    if isinstance(model, CausalLM):  # the job converts the transformers model it wraps, by that model's plan
        return [replace(e, name=f"lm.{e.name}") for e in param_entries(model.lm, plan, tp)]
    # (adapter factors are bigdense layers on any model; the model's own layers say whether it is converted)
    has_tp_layers = any(isinstance(m, TensorParallelModule) and not isinstance(m, LoRAFactor) for m in model.modules())
    planned = {}
    if plan is not None or not has_tp_layers:
        planned = {**planned_splits(model, plan, tp), **adapter_splits(model, plan, tp)}
    entries, seen = [], set()
    for module_name, module in model.named_modules():
        declared = module._shards if isinstance(module, TensorParallelModule) else {}
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{module_name}.{pname}" if module_name else pname
            if pname in declared:
                shape, dim, packed = declared[pname]
            else:
                shape, (dim, packed) = tuple(p.shape), planned.get(full, (None, 1))
            held = p.element_size() if not p.requires_grad and p.is_floating_point() and p.element_size() < 4 else 0
            entries.append(ParamEntry(full, tuple(shape), dim, p.requires_grad, packed, held))
    return entries


def adapter_splits(model: nn.Module, plan: Optional[Mapping] = None, tp: Optional[int] = None) -> dict:
    """``{factor parameter name: (split dim, packed blocks)}`` of the adapters on ``model``'s plain
    layers that ``parallelize(model, plan)`` at ``tp`` converts as column or row layers: as
    `attach_lora` splits the factors of the converted layer (read from a meta twin that carries
    the layer's style, adapted alike; the split rule is `bigdense.layers.lora`'s)."""
    from ..parallel import comm
    from ..parallel.context import resolve_tp_group
    from ..parallelize.plans import plan_conversion

    if not any(lora_settings(m) is not None for m in model.modules()):
        return {}
    tp = comm.group_size(resolve_tp_group(None)) if tp is None else tp
    out = {}
    for entry in plan_conversion(model, plan, tp).entries.values():
        layer = model.get_submodule(entry.owner)
        settings = lora_settings(layer)
        if settings is None or entry.param is not None or entry.style.name not in ("column", "row"):
            continue
        kind = adapted_kind(layer)
        twin = nn.Linear(kind.in_features, kind.out_features, bias=False, device="meta")
        twin.bd_style = entry.style  # what `parallelize` leaves on a layer it converts (in place or not)
        attach_lora(twin, settings, entry.owner)
        for factor in ("lora_A", "lora_B"):
            declared = getattr(twin, factor)._shards.get("weight")
            if declared is not None:
                out[f"{entry.owner}.{factor}.weight"] = declared[1:]
    return out


def bytes_per_rank(entries, tp: int, width: int) -> list[int]:
    """Bytes of the parameters each TP rank holds, in rank order: ``width`` per element, or the
    entry's own narrower width (`ParamEntry.held_bytes`)."""
    return [sum(e.local_numel(tp, r) * (e.held_bytes or width) for e in entries) for r in range(tp)]


def count_per_rank(entries, tp: int, trainable_only: bool = False) -> list[int]:
    """Elements held by each TP rank, in rank order."""
    return [
        sum(e.local_numel(tp, r) for e in entries if e.trainable or not trainable_only) for r in range(tp)
    ]
