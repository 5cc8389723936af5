"""Column/Row-parallel layers with the weight layout of Hugging Face's ``Conv1D`` (GPT-2, GPT).

``transformers.pytorch_utils.Conv1D`` is a linear layer whose weight is stored transposed,
``(in_features, out_features)``, computing ``y = x W + b``. These layers compute exactly what
`ColumnParallelLinear`/`RowParallelLinear` compute and keep the ``Conv1D`` layout, so a converted
GPT-2 saves, exports and reloads under its own parameter names and shapes: column splits the
weight's last dim, row its first. Built by `bigdense.parallelize` from a ``Conv1D`` (no import of
``transformers`` here: any module with ``nx``, ``nf``, ``weight (nx, nf)`` and ``bias`` converts).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .linear import ColumnParallelLinear, RowParallelLinear


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (by its interface, not its class, so transformers stays optional)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


class _Conv1DLayout:
    """Stores the weight as ``(in, out)`` (this rank's slice); `ColumnParallelLinear` /
    `RowParallelLinear` provide everything else through ``_linear_weight``."""

    def _to_conv1d_layout(self) -> None:
        # The parent initialised an (out, in) shard; the same values, transposed, are the Conv1D shard.
        self.weight = nn.Parameter(self.weight.detach().t().contiguous())
        self._declare_shard("weight", (self.in_features, self.out_features), 1 - self._split_dim)

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    def reset_parameters(self) -> None:
        if "weight" in self._shards and self._shards["weight"][1] != self._split_dim:  # already (in, out)
            stored = self.weight
            self.weight = nn.Parameter(torch.empty_like(stored.t()))
            super().reset_parameters()
            with torch.no_grad():
                stored.copy_(self.weight.t())
            self.weight = stored
        else:
            super().reset_parameters()

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's slice of a full Conv1D weight ``(in_features, out_features)`` (and bias)."""
        if tuple(weight.shape) != (self.in_features, self.out_features):
            raise ValueError(f"{self._where()}: full Conv1D weight must have shape "
                             f"{(self.in_features, self.out_features)}, got {tuple(weight.shape)}")
        self.weight.copy_(self.shard_spec("weight").slice_of(weight))
        self._load_dense_bias_(bias)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` computing the same (its weight is the transpose), on every rank (a collective)."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        dense.weight.copy_(self.gather_param("weight").t())
        if self.bias is not None:
            dense.bias.copy_(self.gather_param("bias"))
        return dense

    @classmethod
    def from_dense(cls, conv1d: nn.Module, **kwargs):
        """This rank's slice of a ``Conv1D`` (same device and dtype); ``kwargs`` as for the parent."""
        if not is_conv1d(conv1d):
            raise TypeError(f"{cls.__name__}.from_dense: expected a transformers Conv1D, got {type(conv1d).__name__}")
        layer = cls(conv1d.nx, conv1d.nf, bias=conv1d.bias is not None, device="meta", dtype=conv1d.weight.dtype,
                    **kwargs)
        layer.to_empty(device=conv1d.weight.device)
        layer.load_dense_(conv1d.weight, conv1d.bias)
        return layer


class ColumnParallelConv1D(_Conv1DLayout, ColumnParallelLinear):
    """`ColumnParallelLinear` with a Conv1D weight: ``(in_features, out_local)`` per rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self._to_conv1d_layout()


class RowParallelConv1D(_Conv1DLayout, RowParallelLinear):
    """`RowParallelLinear` with a Conv1D weight: ``(in_local, out_features)`` per rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self._to_conv1d_layout()
