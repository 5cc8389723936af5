"""int8 weights for inference: weight-only, symmetric, one scale per output feature.

    model = bd.quantize_int8(model)          # every dense layer (or layers=["blocks.*.mlp.*"])
    layer8 = bd.quantize_int8(layer)         # one layer: its Int8Linear

For output feature j, ``scale_j = max_i |W_ji| / 127`` over the WHOLE row of the unsharded weight and
``q_ji = round(W_ji / scale_j)`` in [-127, 127]. A column layer holds whole rows; a row layer's rows
are split over TP, so their maxima are one all-reduce (MAX) of the per-shard maxima: nothing is
gathered, and the int8 values and scales are bit-identical at every TP size. The int8 weight is
sharded like the float weight (``weight``, ``(out, in)`` split as the layer's), ``weight_scale``
(``(out,)``) like the layer's output features; both are saved in checkpoints under those names.

Each weight is off by at most ``scale_j / 2``, so an output is off by at most
``scale_j / 2 * ||x||_1`` (plus float rounding). The forward computes ``(x q^T) * scale``:

* on CPU with bf16 or fp16 activations, torch's fused kernel ``torch._weight_int8pack_mm`` (its
  widths must be a multiple of `FUSED_MULTIPLE`: it crashes or returns garbage on others);
* otherwise the int8 weight is converted a tile of output rows at a time (`TILE_ELEMENTS` weights,
  which stay in cache on a CPU; all of it at once on other devices) and multiplied in the
  activations' dtype: never a whole float copy of a large weight.

Plain PyTorch reads the export (`bd.export_dense` of a checkpoint of the quantised model) as
``weight.float() * weight_scale[:, None]``: docs/compression.md has the lines.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel import comm
from ..layers.base import replace_module
from .inference import InferenceLinear, is_dense, masked_weight, matching_layers

QMAX = 127  # symmetric: -127..127, so that -q is representable for every q
TILE_ELEMENTS = 1 << 19  # weights converted at a time on CPU: 2 MiB in fp32
FUSED_MULTIPLE = 64  # torch._weight_int8pack_mm (2.13, CPU) needs widths that are multiples of its vectors


def per_row_scales(weight: torch.Tensor, group, split_rows: bool, dtype: torch.dtype) -> torch.Tensor:
    """``max_i |W_ji| / 127`` per row j, rounded to ``dtype``; ``split_rows``: this rank holds a slice
    of each row (a row-parallel layer), and the maxima are all-reduced (MAX) over ``group``."""
    # (A rank holding no columns, an uneven split of fewer inputs than ranks, contributes zeros.)
    row_max = weight.abs().amax(dim=1) if weight.shape[1] else weight.new_zeros(weight.shape[0])
    row_max = row_max.to(torch.float32)
    if split_rows:
        comm.all_reduce_(row_max, group, op=dist.ReduceOp.MAX)
    return (row_max / QMAX).to(dtype)


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(W / scale)`` per row, in int8 (a zero row, scale 0, stays zero)."""
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    return torch.round(weight.to(torch.float32) / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)


class Int8Linear(InferenceLinear):
    """A dense layer with int8 weights for inference (see the module docstring): the layer's interface,
    shapes and communication (`bigdense.compression.inference`). Buffers: ``weight`` (int8, this rank's
    ``(out_local, in_local)``), ``weight_scale`` (the layer's dtype, this rank's output features),
    ``bias``. Building one from a row-parallel layer is a collective (the row maxima), as is its
    `load_dense_`; `to_dense` gives the dequantised layer."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer, "Int8Linear")
        self._store_weight(masked_weight(layer))

    def _store_weight(self, weight: torch.Tensor) -> None:
        if not weight.is_floating_point():
            raise TypeError(f"Int8Linear: expected a floating-point weight, got {weight.dtype}")
        # Every rank of a row layer takes part, an empty shard too (its maxima are zeros).
        scale = per_row_scales(weight, self.tp_group, self.kind == "row", weight.dtype)
        self.register_buffer("weight", quantize_rows(weight, scale))
        self.register_buffer("weight_scale", scale)
        self._declare_weight_like("weight")
        self._declare_per_output("weight_scale")

    def _reference_tensor(self) -> torch.Tensor:
        return self.weight_scale

    def dequantized_weight(self) -> torch.Tensor:
        """This rank's ``q * scale``, ``(out_local, in_local)``, in the scales' dtype."""
        return self.weight.to(self.weight_scale.dtype) * self.weight_scale[:, None]

    def _dense_weight(self) -> torch.Tensor:
        return self.dequantized_weight()

    def _fused(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] > 0
                and self.local_in_features % FUSED_MULTIPLE == 0 and hasattr(torch, "_weight_int8pack_mm"))

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return torch._weight_int8pack_mm(x.contiguous(), self.weight, self.weight_scale.to(x.dtype))
        rows = self.weight.shape[0]
        tile = max(1, TILE_ELEMENTS // max(1, self.weight.shape[1])) if x.device.type == "cpu" else rows
        scale = self.weight_scale.to(x.dtype)
        if tile >= rows:
            return (x @ self.weight.to(x.dtype).t()) * scale
        out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
        for lo in range(0, rows, tile):
            hi = min(rows, lo + tile)
            out[:, lo:hi] = (x @ self.weight[lo:hi].to(x.dtype).t()) * scale[lo:hi]
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8 weights, per-output scales"


@torch.no_grad()
def quantize_int8(module: nn.Module, *, layers: Optional[list[str]] = None) -> nn.Module:
    """int8 weights for the dense layers of ``module`` (`Int8Linear`, in place), or for ``module``
    itself when it is one dense layer (its `Int8Linear` is returned).

    ``layers``: fnmatch patterns of module names (default: every ``nn.Linear``,
    `ColumnParallelLinear` and `RowParallelLinear`, not classifier heads). A pruned layer keeps its
    zeros (its mask is applied first). Collective when the model is sharded: every TP rank calls it.
    """
    targets = matching_layers(module, layers, is_dense)
    if layers is not None and not targets:
        raise ValueError(f"quantize_int8: layers={layers} matches no dense layer of {type(module).__name__}")
    if not targets:
        Int8Linear(module)  # raises naming what it got
    for name, layer in targets:
        module = replace_module(module, name, Int8Linear(layer))
    return module
