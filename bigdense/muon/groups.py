"""Which parameters Muon steps: the 2-D weights of dense layers. AdamW steps the rest.

Muon's matrices: the weight of every linear layer -- bigdense's column and row layers (MLPs,
attention projections), modules a plan converted in place with a column or row style, plain
``nn.Linear`` and transformers' ``Conv1D`` -- except the layer that produces the logits (the
output head, tied or not: its rows are class vectors, not a linear map between hidden spaces,
as Moonlight and Keller Jordan's Muon leave it to AdamW). AdamW takes embeddings, the head, norms,
biases and low-rank adapter factors, with weight decay on matrices only (the engines' rule).
"""
from __future__ import annotations

import torch.nn as nn

from ..layers.lora import adapted_kind, output_heads
from ..parallel.sharding import is_world_sharded


def _dense_layer(module: nn.Module) -> bool:
    if adapted_kind(module) is not None:
        return True
    style = getattr(module, "bd_style", None)  # a Conv1D converted in place
    return type(module).__name__ == "Conv1D" and getattr(style, "name", None) in ("column", "row")


def muon_names(model: nn.Module) -> list[str]:
    """Names of the parameters Muon steps (trainable 2-D weights of dense layers), in model order."""
    heads = output_heads(model)
    modules = dict(model.named_modules())
    head_params = {id(p) for m in modules.values() if id(m) in heads for p in m.parameters()}
    names = []
    for name, p in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        if (p.requires_grad and p.dim() == 2 and name.endswith("weight") and _dense_layer(owner)
                and id(p) not in head_params and not is_world_sharded(p)):
            names.append(name)
    return names


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Muon's group (``"muon": True``: the dense weights) and AdamW's (matrices with weight decay,
    vectors without); empty groups left out."""
    chosen = set(muon_names(model))
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # a tied weight comes once, under its first name
        if p.requires_grad:
            (muon if name in chosen else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": muon, "weight_decay": float(weight_decay), "muon": True},
              {"params": decay, "weight_decay": float(weight_decay), "muon": False},
              {"params": no_decay, "weight_decay": 0.0, "muon": False}]
    return [g for g in groups if g["params"]]
