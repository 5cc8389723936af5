"""Normalisation layers whose parameters are replicated over TP and which may run on sequence shares.

Under sequence parallelism each TP rank normalises its own share of the sequence, so the
gradient of the (replicated) weight and bias on one rank is a partial sum. These layers pass their
parameters through `partial_grads.with_partial_grad` (forward identity, backward all-reduce over
TP), so after ``backward()`` every rank holds the full gradient, exactly as without sequence
parallelism, and clipping, optimizers and checkpoints treat them as ordinary replicated
parameters (a training engine may defer that sum to one all-reduce per step: `partial_grads`). State-dict
names are ``nn.LayerNorm``'s and ``nn.RMSNorm``'s, so checkpoints do not depend on the setting.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.partial_grads import with_partial_grad
from .base import DenseTwin, device_dtype_of


class _SequenceParallelNorm(DenseTwin):
    """What both norms share: the group, the flag, the parameters as the forward sees them, and the
    plain twin (`DenseTwin`): the torch norm, its parameters replicated, so ``to_dense`` is a copy and
    no collective; ``from_dense(norm, sequence_parallel=..., tp_group=...)``."""

    @classmethod
    def _empty_from_dense(cls, norm: nn.Module, *, sequence_parallel: bool = False, tp_group=None):
        options = {"bias": norm.bias is not None} if isinstance(norm, nn.LayerNorm) else {}
        return cls(norm.normalized_shape, norm.eps, norm.elementwise_affine, sequence_parallel=sequence_parallel,
                   tp_group=tp_group, **options, **device_dtype_of(norm))

    def _setup_sp(self, sequence_parallel: bool, tp_group) -> None:
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_group = resolve_tp_group(tp_group)

    def _params(self):
        params = (self.weight, getattr(self, "bias", None))
        if not self.sequence_parallel:
            return params
        return tuple(None if p is None else with_partial_grad(p, self.tp_group) for p in params)

    def bd_partial_grad_params(self) -> list:
        """The parameters whose gradient is partial over TP (`bigdense.parallel.partial_grads`)."""
        if not self.sequence_parallel or comm.group_size(self.tp_group) == 1:
            return []
        return [p for p in (self.weight, getattr(self, "bias", None)) if p is not None]


class LayerNorm(_SequenceParallelNorm, nn.LayerNorm):
    """``nn.LayerNorm`` over the last dims; ``sequence_parallel=True`` sums its parameters'
    gradients over TP in backward (input: this rank's share of the sequence)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *,
                 sequence_parallel: bool = False, tp_group=None, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self._setup_sp(sequence_parallel, tp_group)

    _dense_kind = nn.LayerNorm

    def _dense_twin(self) -> nn.LayerNorm:
        return nn.LayerNorm(self.normalized_shape, self.eps, self.elementwise_affine, bias=self.bias is not None,
                            device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params()
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(_SequenceParallelNorm, nn.RMSNorm):
    """``nn.RMSNorm`` over the last dims; ``sequence_parallel=True`` sums its weight's gradient
    over TP in backward (input: this rank's share of the sequence)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine: bool = True, *,
                 sequence_parallel: bool = False, tp_group=None, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self._setup_sp(sequence_parallel, tp_group)

    _dense_kind = nn.RMSNorm

    def _dense_twin(self) -> nn.RMSNorm:
        return nn.RMSNorm(self.normalized_shape, self.eps, self.elementwise_affine, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self._params()
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
