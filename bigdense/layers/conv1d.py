"""Column/Row-parallel layers with the weight layout of Hugging Face's ``Conv1D`` (GPT-2, GPT).

``transformers.pytorch_utils.Conv1D`` is a linear layer whose weight is stored transposed,
``(in_features, out_features)``, computing ``y = x W + b``. These layers compute exactly what
`ColumnParallelLinear`/`RowParallelLinear` compute and keep the ``Conv1D`` layout, so a converted
GPT-2 saves, exports and reloads under its own parameter names and shapes: column splits the
weight's last dim, row its first. Built by `bigdense.parallelize` from a ``Conv1D`` (no import of
``transformers`` here: any module with ``nx``, ``nf``, ``weight (nx, nf)`` and ``bias`` converts).
"""
from __future__ import annotations

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

    # The plain twin is an nn.Linear (transformers' Conv1D is not torch's): `to_dense` transposes the
    # weight into it; `from_dense` and `load_dense_` take a Conv1D and its (in, out) layout.
    @classmethod
    def _check_dense(cls, conv1d, method: str) -> None:
        if not is_conv1d(conv1d):
            raise TypeError(f"{cls.__name__}.{method}: expected a transformers Conv1D, got {type(conv1d).__name__}")

    @classmethod
    def _dense_features(cls, conv1d: nn.Module) -> tuple[int, int]:
        return conv1d.nx, conv1d.nf

    def _full_tensor(self, name: str) -> torch.Tensor:
        full = super()._full_tensor(name)
        return full.t().contiguous() if name == "weight" else full


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
