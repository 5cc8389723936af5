"""A model's units for sharding by unit (FSDP2, `bigdense.train.engines.fsdp.apply_fsdp`; the memory
planner's model of it, `bigdense.plan.fsdp`): the one owner of how a model's edges are grouped."""
from __future__ import annotations

import torch.nn as nn


def edge_units(model: nn.Module) -> list[list[nn.Module]]:
    """The model's inputs and outputs (its ``edges()``: embeddings; final norm and head) as units,
    modules without parameters left out; one unit when they share a parameter (tied embeddings),
    since FSDP needs a shared parameter in one unit. Empty for a model without ``edges``."""
    edges = getattr(model, "edges", None)
    if edges is None:
        return []
    units = [[m for m in modules if any(True for _ in m.parameters())] for modules in edges()]
    units = [u for u in units if u]
    if len(units) == 2 and _shared(units[0], units[1]):
        units = [units[0] + units[1]]
    return units


def _shared(a: list[nn.Module], b: list[nn.Module]) -> bool:
    ids = {id(p) for m in a for p in m.parameters()}
    return any(id(p) in ids for m in b for p in m.parameters())
