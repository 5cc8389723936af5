"""Inference-only stand-ins for a dense layer: its interface and communication around another local
product (a sparse weight, `bigdense.compression.sparse`; an int8 weight, `bigdense.compression.quant`).

A stand-in is built from an ``nn.Linear``, `ColumnParallelLinear` or `RowParallelLinear` (sharded or
not, balanced or uneven) and communicates exactly as that layer does, through the same regions of
`bigdense.parallel.regions`:

* column: the input enters the TP region (under sequence parallelism, gathered along the sequence);
  this rank's output features come out, all-gathered with ``gather_output``;
* row: this rank's slice of the input features (split here with ``input_is_parallel=False``), the
  partial products all-reduced (reduce-scattered along the sequence under sequence parallelism),
  the bias added once;
* ``nn.Linear``: no communication.

Only the product of this rank's weight shard with its input changes (``_product``). A rank whose
shard is empty -- an uneven split of fewer features than ranks leaves it no input (row) or output
(column) feature -- multiplies by nothing: its product is zeros of the right shape, computed here
for every stand-in (``_local``), never by a subclass's kernel, and it still takes part in every
collective of the layer, forward and backward, as the float layer's empty shard does.

A stand-in holds no parameters: its tensors are buffers (nothing to train), and gradients reach the
input at most. Like the float layers it has ``from_dense`` (its construction from a dense layer),
``to_dense`` (the ``nn.Linear`` it computes: dequantised, or its kept weights) and ``load_dense_``.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel import comm
from ..parallel.regions import (
    copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence, scatter_to_tp,
)
from ..parallel.sharding import shard_range
from ..layers.base import TensorParallelModule
from ..layers.conv1d import ColumnParallelConv1D, RowParallelConv1D
from ..layers.head import ParallelClassifierHead
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .prune_masks import mask_of

KINDS = ("linear", "column", "row")


def dense_kind(layer: nn.Module, who: str) -> str:
    """``"linear"``, ``"column"`` or ``"row"``: the layer a stand-in can replace; a TypeError otherwise."""
    unsupported = (ParallelClassifierHead, ColumnParallelConv1D, RowParallelConv1D)
    if isinstance(layer, ColumnParallelLinear) and not isinstance(layer, unsupported):
        return "column"
    if isinstance(layer, RowParallelLinear) and not isinstance(layer, unsupported):
        return "row"
    if isinstance(layer, nn.Linear):
        return "linear"
    raise TypeError(f"{who}: expected an nn.Linear, ColumnParallelLinear or RowParallelLinear (not a classifier "
                    f"head, whose loss reads its weight whole, nor a Conv1D layout), got {type(layer).__name__}")


def is_dense(layer: nn.Module) -> bool:
    """Whether a stand-in can replace ``layer`` (`dense_kind` would not raise)."""
    try:
        dense_kind(layer, "")
    except TypeError:
        return False
    return True


def masked_weight(layer: nn.Module) -> torch.Tensor:
    """This rank's weight ``(out_local, in_local)`` as the layer computes with it: times its pruning
    mask (``weight_mask``, `bd.prune`'s buffer) when it has one, detached."""
    weight = layer.weight.detach()
    mask = mask_of(layer)
    return weight if mask is None else weight * mask.to(weight.dtype)


def matching_layers(module: nn.Module, patterns: Optional[list[str]], want) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of the submodules (``module`` itself included, named ``""``) for which
    ``want(layer)`` holds and whose name matches a pattern (fnmatch; every name when ``patterns`` is
    None), in ``named_modules`` order: the same on every rank. Not inside a matched layer."""
    found, inside = [], []
    for name, sub in module.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if want(sub) and (patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            found.append((name, sub))
            inside.append(name)
    return found


class InferenceLinear(TensorParallelModule):
    """Base of the stand-ins (see the module docstring). A subclass stores this rank's weight shard in
    its own form (``_store_weight``, from its dense ``(out_local, in_local)`` values; called by its
    ``__init__`` and by `load_dense_`), multiplies by it (``_product(x2d)``: ``x W_local^T`` in
    ``x``'s dtype, only ever for a shard that `holds_weight`) and gives its values back densely
    (``_dense_weight``)."""

    def __init__(self, layer: nn.Module, who: str):
        super().__init__()
        self.kind = dense_kind(layer, who)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        # Built from a layer, not from seeds: no `_setup_tp` (it would draw a seed from the RNG).
        self.tp_group = getattr(layer, "tp_group", None) if self.kind != "linear" else None
        self.tp_size, self.tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        self._shards = {}
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        self.gather_output = bool(getattr(layer, "gather_output", False))
        self.input_is_parallel = bool(getattr(layer, "input_is_parallel", True))
        split = {"column": self.out_features, "row": self.in_features}.get(self.kind)
        if split is None:
            self.partition_sizes, self.partition_start, self.partition_size = None, 0, None
        else:
            self.partition_sizes = list(layer.partition_sizes)
            lo, hi = shard_range(split, self.tp_size, self.tp_rank)
            self.partition_start, self.partition_size = lo, hi - lo
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone())
        if self.kind == "column" and self.bias is not None:
            self._declare_shard("bias", (self.out_features,), 0)

    # ---- what a subclass uses ----
    @property
    def local_in_features(self) -> int:
        return self.partition_size if self.kind == "row" else self.in_features

    @property
    def local_out_features(self) -> int:
        return self.partition_size if self.kind == "column" else self.out_features

    def _declare_weight_like(self, name: str) -> None:
        """Buffer ``name`` is this rank's ``(out, in)`` weight shard, split as the layer's was."""
        if self.kind != "linear":
            self._declare_shard(name, (self.out_features, self.in_features), 0 if self.kind == "column" else 1)

    def _declare_per_output(self, name: str) -> None:
        """Buffer ``name`` holds one value per output feature: split by a column layer, whole otherwise."""
        if self.kind == "column":
            self._declare_shard(name, (self.out_features,), 0)

    @property
    def holds_weight(self) -> bool:
        """Whether this rank's shard has any weight: not when an uneven split leaves it no input (row)
        or output (column) feature. Its product is then zeros (`_local`), whatever the subclass."""
        return self.local_in_features > 0 and self.local_out_features > 0

    def _store_weight(self, weight: torch.Tensor) -> None:
        """Register this rank's ``(out_local, in_local)`` weight (dense, masked) in the subclass's form."""
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dense_weight(self) -> torch.Tensor:
        """This rank's ``(out_local, in_local)`` weight as the product uses it, dense."""
        raise NotImplementedError

    def _reference_tensor(self) -> torch.Tensor:
        """A floating-point buffer whose device and dtype the input must have."""
        raise NotImplementedError

    # ---- to and from a dense layer (the float layers' trio, `bigdense.layers.base`) ----
    @classmethod
    def from_dense(cls, layer: nn.Module, **options) -> "InferenceLinear":
        """The stand-in of ``layer`` (``nn.Linear``, column or row; its mask applied), in its
        train/eval mode: the constructor, with its ``options``."""
        return cls(layer, **options).train(layer.training)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The ``nn.Linear`` this stand-in computes (its dequantised or kept weights, and the bias),
        whole on every rank: a collective when sharded, like the float layers' ``to_dense``."""
        local = self._dense_weight()
        if self.kind == "linear":
            weight = local
        else:
            dim = 0 if self.kind == "column" else 1
            weight = comm.all_gather_dim(local.contiguous(), dim, self.tp_group, self.partition_sizes)
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=local.device,
                          dtype=local.dtype)
        dense.weight.copy_(weight)
        if self.bias is not None:
            dense.bias.copy_(self.gather_param("bias"))
        return dense.train(self.training)

    @torch.no_grad()
    def load_dense_(self, weight, bias: Optional[torch.Tensor] = None) -> "InferenceLinear":
        """Rebuild this stand-in from a plain ``nn.Linear`` (or its state dict, or its full ``(out_features,
        in_features)`` weight and its bias): this rank's slice stored as at construction (a row
        layer's int8 scales are then a collective), the bias copied. Returns the stand-in."""
        if isinstance(weight, nn.Linear):
            weight = weight.state_dict()
        if isinstance(weight, Mapping):
            weight, bias = weight.get("weight"), weight.get("bias")
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.out_features, self.in_features):
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{self._where()}: load_dense_ expects an nn.Linear or a full weight of shape "
                             f"{(self.out_features, self.in_features)}, got {got}")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{self._where()}: load_dense_: bias is {'missing' if bias is None else 'unexpected'}")
        ref = self._reference_tensor()
        if self.kind != "linear":
            weight = weight.narrow(0 if self.kind == "column" else 1, self.partition_start, self.partition_size)
        self._store_weight(weight.detach().to(device=ref.device, dtype=ref.dtype))
        if bias is not None:
            spec = self.shard_spec("bias")
            self.bias.copy_(bias if spec is None else spec.slice_of(bias))
        return self

    # ---- the layer's interface ----
    def _describe_shape(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def extra_repr(self) -> str:
        sharded = "" if self.kind == "linear" else f", {self.kind}-parallel, tp={self.tp_size}"
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"{self._describe_shape()}, bias={self.bias is not None}{sharded}{sp}"

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        ref = self._reference_tensor()
        if self.kind == "row":
            return self._row_forward(x, ref)
        if self.kind == "column":
            what = "this rank's share of the sequence" if self.sequence_parallel else "replicated on every TP rank"
            self._check_input(x, self.in_features, f"in_features, {what}", ref)
            if self.sequence_parallel:
                x = gather_from_sequence(x, self.tp_group, self._sequence_shares(x, seq_len))
            else:
                x = copy_to_tp(x, self.tp_group)
        else:
            self._check_input(x, self.in_features, "in_features", ref)
        y = self._local(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.kind == "column" and self.gather_output:
            y = gather_from_tp(y, self.tp_group, self.partition_sizes)
        return y

    def _row_forward(self, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            what = f"this rank's slice of in_features={self.in_features}, input_is_parallel=True"
            self._check_input(x, self.partition_size, what, ref)
        else:
            self._check_input(x, self.in_features, "in_features, input_is_parallel=False", ref)
            x = scatter_to_tp(x, self.tp_group, self.partition_sizes)
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(f"{self._where()}: sequence_parallel=True expects input (*, S, in), got {tuple(x.shape)}")
        y = self._local(x)
        y = reduce_scatter_to_sequence(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(y, self.tp_group)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product of ``x`` (*, in_local) as a matrix, reshaped back to (*, out_local)."""
        # The rows counted, not -1: an input with no feature on this rank has 0 elements, and -1 is
        # then ambiguous.
        flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        y = self._product(flat) if self.holds_weight else self._empty_product(flat)
        return y.reshape(*x.shape[:-1], self.local_out_features)

    def _empty_product(self, flat: torch.Tensor) -> torch.Tensor:
        """The product with an empty shard: zeros, (rows, out_local). Through a weight of 0 elements,
        so that the output depends on the input as on a peer (the backward's collectives of the
        input's region run on this rank too); the subclasses' kernels are never asked for it."""
        return F.linear(flat, flat.new_zeros(self.local_out_features, flat.shape[-1]))
