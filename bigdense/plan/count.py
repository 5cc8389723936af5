"""Exact parameter counts of a module at any TP size, from its layers' shard declarations or a plan.

Every parameter becomes a `ParamEntry`: its global shape and the dimension TP splits it along
(``None``: replicated on every TP rank). bigdense layers declare theirs (``_shards``, the same
declarations checkpoints read); plain ``nn.Linear``/``nn.Embedding`` modules get theirs from the
plan `bigdense.parallelize` would apply (`tp_plan`), so the count is of the model
``parallelize(model, plan)`` would build. Nothing is allocated: meta-device modules work. A weight
shared by several modules (tied embedding and head) is one entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..models import CausalLM
from ..parallel.sharding import shard_sizes

@dataclass(frozen=True)
class ParamEntry:
    name: str
    global_shape: tuple[int, ...]
    split_dim: Optional[int]  # None: replicated over TP
    trainable: bool = True
    packed: int = 1  # blocks along split_dim, each split on its own (a fused [gate; up] projection)

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
    has_tp_layers = any(isinstance(m, TensorParallelModule) for m in model.modules())
    planned = planned_splits(model, plan, tp) if (plan is not None or not has_tp_layers) else {}
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
            entries.append(ParamEntry(full, tuple(shape), dim, p.requires_grad, packed))
    return entries


def count_per_rank(entries, tp: int, trainable_only: bool = False) -> list[int]:
    """Elements held by each TP rank, in rank order."""
    return [
        sum(e.local_numel(tp, r) for e in entries if e.trainable or not trainable_only) for r in range(tp)
    ]
