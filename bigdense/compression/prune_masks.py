"""A pruned layer's mask, ``weight_mask``, and how the pruned entries stay zero through training.

The mask is a persistent bool buffer of the weight's local shape, True where the entry stays. On a
bigdense layer it is declared sharded exactly like the weight (`TensorParallelModule._declare_shard`),
so checkpoints save it layout-free and load it at any TP size, as they do the weight.

It is held physically rather than multiplied in at every forward: `ParallelMLP` applies its
``up``/``gate`` projections by reading their weights directly (so a forward hook on them would not
fire), and a product in the forward would cost a weight-sized temporary per layer per step. Instead

- the pruned entries are zeroed when the mask is set;
- a hook on the weight multiplies its gradient by the mask, so the gradient (and the norm that
  clipping and the metrics measure) is exactly that of ``weight * mask`` in the forward;
- `MaskKeeper` (``bd.apply_masks``) re-zeroes them after each optimizer step: AdamW's moments from
  before the pruning, and its weight decay, would otherwise move them. The DDP engine calls it.

At every step the weight then equals ``weight * mask``: the same forward, gradients and updates as
applying the mask in the forward.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

from ..parallel.sharding import is_dtensor
from ..layers.base import TensorParallelModule

MASK = "weight_mask"
_changes = [0]  # bumped whenever a mask is added anywhere: `MaskKeeper` looks for masks again


def mask_of(layer: nn.Module) -> Optional[torch.Tensor]:
    """The layer's ``weight_mask`` (True: kept), or None when it has none."""
    return layer._buffers.get(MASK)


class _MaskGradient:
    """The weight's gradient hook: the gradient of ``weight * mask``. It reads the layer's current
    mask (a load replaces its values), through a weak reference (no reference cycle)."""

    def __init__(self, layer: nn.Module):
        self.layer = weakref.ref(layer)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        layer = self.layer()
        return grad if layer is None else grad * layer._buffers[MASK]


@torch.no_grad()
def set_mask_(layer: nn.Module, keep: torch.Tensor) -> None:
    """Make ``keep`` (bool, the weight's local shape) the layer's mask and zero the pruned entries."""
    weight = layer.weight
    if tuple(keep.shape) != tuple(weight.shape):
        raise ValueError(f"{type(layer).__name__}: a mask of shape {tuple(keep.shape)} for a weight of local shape "
                         f"{tuple(weight.shape)}")
    current = mask_of(layer)
    if current is not None:
        current.copy_(keep)
    else:
        layer.register_buffer(MASK, keep.to(device=weight.device, dtype=torch.bool).clone(), persistent=True)
        if isinstance(layer, TensorParallelModule) and "weight" in layer._shards:
            layer._declare_shard(MASK, *layer._shards["weight"])  # sharded like its weight
        layer._bd_mask_hook = weight.register_hook(_MaskGradient(layer))
        _changes[0] += 1
    weight.mul_(layer._buffers[MASK])


class MaskKeeper:
    """``keeper()`` re-zeroes the pruned entries of every masked layer of ``model`` (after an
    optimizer step). The masked layers are looked up again only when a mask was added somewhere
    since the last call, so a model without masks costs a comparison of two integers per step, and
    none reads the device on the host."""

    def __init__(self, model: nn.Module):
        self.model, self._seen, self._layers = model, -1, []

    def _refresh(self) -> None:
        layers = [(name, m) for name, m in self.model.named_modules() if mask_of(m) is not None]
        for name, m in layers:
            if is_dtensor(m.weight):
                raise TypeError(f"{name}: a pruned layer whose weight is FSDP-sharded (engine=fsdp) cannot keep its "
                                f"mask; train pruned models with engine=ddp")
        self._layers, self._seen = [m for _, m in layers], _changes[0]

    @torch.no_grad()
    def __call__(self) -> int:
        if self._seen != _changes[0]:
            self._refresh()
        for layer in self._layers:
            layer.weight.mul_(layer._buffers[MASK])
        return len(self._layers)


def apply_masks(model: nn.Module) -> int:
    """Zero the pruned entries of every masked layer of ``model`` (``weight *= weight_mask``); call it
    after each optimizer step of a loop of your own (bigdense's DDP engine does). Returns how many
    layers have masks."""
    return MaskKeeper(model)()


def attach_saved_masks(model: nn.Module, saved_names) -> list[str]:
    """Give each layer of ``model`` that a checkpoint holds a ``<layer>.weight_mask`` for (its model
    tensor names ``saved_names``) an all-True mask where it has none, for the load to fill: a pruned
    model's checkpoint then loads into the unpruned model it was built as (a fine-tune's
    ``trainer.init_from``, a resume). An all-True mask changes no value. Returns the layers given one."""
    attached = []
    for name in saved_names:
        if not name.endswith("." + MASK):
            continue
        layer_name = name[: -len(MASK) - 1]
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError:
            continue  # not this model's: the load names it as unexpected
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and mask_of(layer) is None:
            set_mask_(layer, torch.ones(weight.shape, dtype=torch.bool, device=weight.device))
            attached.append(layer_name)
    return attached
