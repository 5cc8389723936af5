"""Column- and row-parallel linear layers (Megatron's split of ``y = x W^T + b``).

Column: ``W`` split by output rows. Each rank computes its slice of the output features.
Row:    ``W`` split by input columns. Each rank multiplies its slice of the input features and the
        partial products are summed over TP.

A Column→(element-wise op)→Row pair needs one all-reduce forward and one backward, and both
sides split the hidden size with the same balanced rule, so they agree on every rank's slice.

With ``sequence_parallel=True`` the activations outside the pair are split along the sequence
(dim -2, each rank its balanced share): Column all-gathers its input forward and reduce-scatters
its input gradient backward; Row reduce-scatters its output forward and all-gathers its gradient
backward. Same bytes as the all-reduces, but everything outside the pair is 1/tp per rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.regions import (
    ColumnComm, column_parallel_linear, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence, scatter_to_tp,
)
from ..parallel.partial_grads import with_partial_grad
from ..parallel.sharding import shard_range, shard_sizes
from ..errors import check_positive_int
from .base import TensorParallelModule, refuse_options
from .init import InitSpec, init_bias_, resolve_init
from .lora import column_delta, lora_settings, row_delta


class _ParallelLinear(TensorParallelModule):
    """Shared parts of Column/Row: parameters, init, dense conversion. ``_split_dim`` is 0 or 1."""

    _split_dim: int

    def __init__(self, in_features, out_features, bias, init, tp_group, device, dtype, sequence_parallel=False):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            check_positive_int(f"{type(self).__name__}: {name}", value)
        self.in_features, self.out_features = in_features, out_features
        self._setup_tp(tp_group)
        self.init = resolve_init(init, f"{type(self).__name__}({in_features}, {out_features})")
        split_total = out_features if self._split_dim == 0 else in_features
        self.partition_sizes = shard_sizes(split_total, self.tp_size)
        lo, hi = shard_range(split_total, self.tp_size, self.tp_rank)
        self.partition_start, self.partition_size = lo, hi - lo

        shape = [out_features, in_features]
        shape[self._split_dim] = self.partition_size
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self._declare_shard("weight", (out_features, in_features), self._split_dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(self._bias_len(), device=device, dtype=dtype))
            if self._split_dim == 0:
                self._declare_shard("bias", (out_features,), 0)
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _linear_weight(self) -> torch.Tensor:
        """This rank's weight as ``F.linear`` takes it, (out, in); a subclass may store it otherwise."""
        return self.weight

    def _bias_len(self) -> int:
        return self.partition_size if self._split_dim == 0 else self.out_features

    def reset_parameters(self) -> None:
        """Fill this rank's shard with its slice of the TP-invariant global initialisation."""
        offsets = (self.partition_start, 0) if self._split_dim == 0 else (0, self.partition_start)
        with torch.no_grad():
            self.init.init_(self.weight, (self.out_features, self.in_features), offsets, self._weight_seed)
            if self.bias is not None:
                bias_offset = self.partition_start if self._split_dim == 0 else 0
                init_bias_(self.bias, self.init, self.in_features, self.out_features, bias_offset, self._weight_seed)

    def _describe_shape(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def extra_repr(self) -> str:
        which = "out_features" if self._split_dim == 0 else "in_features"
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return (
            f"{self._describe_shape()}, bias={self.bias is not None}, "
            f"{which} on this rank={self.partition_size}, tp={self.tp_size}, init={self.init.name}{sp}"
        )

    # ---- the plain twin (`DenseTwin`): an nn.Linear ----
    _dense_kind = nn.Linear

    def _dense_twin(self) -> nn.Linear:
        return nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                         dtype=self.weight.dtype)

    @classmethod
    def _dense_features(cls, linear: nn.Module) -> tuple[int, int]:
        """``(in_features, out_features)`` of the plain module `from_dense` converts."""
        return linear.in_features, linear.out_features

    @classmethod
    def _empty_from_dense(cls, linear: nn.Module, **options):
        source = "nn.Linear" if isinstance(linear, nn.Linear) else type(linear).__name__  # or a Conv1D
        refuse_options(cls, options, ("bias", "device", "dtype", "init"), source)
        layer = cls(*cls._dense_features(linear), bias=linear.bias is not None, device="meta",
                    dtype=linear.weight.dtype, **options)
        return layer.to_empty(device=linear.weight.device)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W`` split by output features over TP.

    Per rank: weight ``(out_local, in_features)``, bias ``(out_local,)``, where ``out_local`` is this
    rank's share of ``out_features`` (balanced; shards differ by at most one row).
    Input ``(*, in_features)``, the same on every TP rank. Output ``(*, out_local)``, or
    ``(*, out_features)`` on every rank with ``gather_output=True``.
    Collectives: backward all-reduce of the input grad; all-gather of the output if gathered.

    ``sequence_parallel=True``: input ``(*, S_local, in_features)``, this rank's balanced share of
    the sequence; output ``(*, S, out_local)``. Forward all-gather of the input along the sequence;
    backward reduce-scatter of the input grad and an all-gather re-gathering the input (which is
    not saved). ``forward(x, seq_len=S)`` states the full length; without it the ranks exchange
    their lengths (see ``_sequence_shares``).
    ``overlap_comm`` (default on): the backward's collectives run while the weight-gradient GEMM
    does; off, each is waited for at once. Gradients are bit-identical either way.
    """

    _split_dim = 0
    lora_kind = "column"  # how a low-rank adapter is split beside it (`bigdense.layers.lora`)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        init: InitSpec = "torch",
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, init, tp_group, device, dtype, sequence_parallel)
        self.gather_output = gather_output
        self.overlap_comm = bool(overlap_comm)

    @property
    def out_features_per_partition(self) -> int:
        return self.partition_size

    def _comm(self, x: torch.Tensor, seq_len: Optional[int]) -> ColumnComm:
        shares = self._sequence_shares(x, seq_len) if self.sequence_parallel else None
        return ColumnComm(self.tp_group, shares, self.overlap_comm)

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        what = "this rank's share of the sequence" if self.sequence_parallel else "replicated on every TP rank"
        self._check_input(x, self.in_features, f"in_features, {what}", self.weight)
        comm_cfg = self._comm(x, seq_len)
        (y,) = column_parallel_linear(x, [(self._linear_weight(), self.bias)], comm_cfg)
        if lora_settings(self) is not None:  # a low-rank adapter (`bigdense.layers.lora`)
            y = y + column_delta(self, x, comm_cfg.seq_sizes)
        if self.gather_output:
            y = gather_from_tp(y, self.tp_group, self.partition_sizes)
        return y


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W`` split by input features over TP.

    Per rank: weight ``(out_features, in_local)``; bias ``(out_features,)`` whole, replicated, added
    once after the reduction. Input ``(*, in_local)`` -- this rank's slice of the last dim, as a
    ColumnParallelLinear produces it -- or ``(*, in_features)`` with ``input_is_parallel=False``,
    which is then split here. Output ``(*, out_features)``, the same on every TP rank.
    Collectives: forward all-reduce of the partial products (all-gather of the input grad when the
    input was split here).

    ``sequence_parallel=True``: input ``(*, S, in_local)``, output ``(*, S_local, out_features)``,
    this rank's balanced share of the sequence: forward reduce-scatter along the sequence instead
    of the all-reduce, backward all-gather. The bias, replicated, is added to the share and its
    gradient summed over TP in backward, so every rank holds the full gradient (or, inside a
    training engine's step, once per step: `bigdense.parallel.partial_grads`).
    """

    _split_dim = 1
    lora_kind = "row"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init: InitSpec = "torch",
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, init, tp_group, device, dtype, sequence_parallel)
        self.input_is_parallel = input_is_parallel

    @property
    def in_features_per_partition(self) -> int:
        return self.partition_size

    def bd_partial_grad_params(self) -> list:
        """The bias under sequence parallelism: each rank adds it to its share only, so its
        gradient is partial over TP (`bigdense.parallel.partial_grads`)."""
        return [self.bias] if self.sequence_parallel and self.bias is not None and self.tp_size > 1 else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            what = f"this rank's slice of in_features={self.in_features}, input_is_parallel=True"
            self._check_input(x, self.partition_size, what, self.weight)
        else:
            self._check_input(x, self.in_features, "in_features, input_is_parallel=False", self.weight)
            x = scatter_to_tp(x, self.tp_group, self.partition_sizes)
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(f"{self._where()}: sequence_parallel=True expects input (*, S, in), got {tuple(x.shape)}")
        y = F.linear(x, self._linear_weight())
        if not self.sequence_parallel:
            y, bias = reduce_from_tp(y, self.tp_group), self.bias
        else:
            # Each rank adds the bias to its share only: its gradient is partial over TP.
            y = reduce_scatter_to_sequence(y, self.tp_group)
            bias = None if self.bias is None else with_partial_grad(self.bias, self.tp_group)
        if lora_settings(self) is not None:  # a low-rank adapter (`bigdense.layers.lora`)
            y = y + row_delta(self, x, self.partition_start)
        return y if bias is None else y + bias.to(y.dtype)
