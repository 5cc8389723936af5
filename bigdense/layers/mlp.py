"""The transformer MLP block, tensor-parallel: column-parallel up, activation, row-parallel down."""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.regions import ColumnComm, column_parallel_linear
from .base import TensorParallelModule, copy_flags, refuse_options, sequence_dropout
from .init import InitSpec
from .lora import column_delta, lora_settings
from .linear import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = ("gelu", "relu", "swiglu")
_ELEMENTWISE = {"gelu": F.gelu, "relu": F.relu}


class ParallelMLP(TensorParallelModule):
    """``down(act(up(x)))``, or ``down(silu(gate(x)) * up(x))`` for ``activation="swiglu"``, then dropout.

    Submodules: ``up`` (and ``gate``) are `ColumnParallelLinear(d_model, d_hidden)` holding this
    rank's slice of the hidden units, weight (hidden_local, d_model); ``down`` is
    `RowParallelLinear(d_hidden, d_model)`, weight (d_model, hidden_local), bias whole. ``gate`` and
    ``up`` use the same balanced split, so each rank's gate and up columns pair up.
    Input and output (*, d_model), the same on every TP rank.

    Collectives: exactly one all-reduce in forward (``down``'s) and one in backward (the input's
    gradient; ``x`` enters the TP region once even though SwiGLU uses it twice). For that reason
    the column projections are applied here on their parameters (`column_parallel_linear`), so
    forward hooks on ``up``/``gate`` do not fire (hooks on the MLP and on ``down`` do). A projection
    replaced by another module mapping (*, d_model) to this rank's hidden slice -- a `bd.low_rank`
    pair, which enters the TP region itself with fewer features, or an int8 or sparse stand-in
    (`bigdense.compression.inference`) -- is called as a module.

    ``sequence_parallel=True``: input and output (*, S_local, d_model), this rank's balanced share
    of the sequence (``forward(x, seq_len=S)`` states S; see `ColumnParallelLinear`). Forward: one
    all-gather of the input and one reduce-scatter of the output; backward: the mirror image plus
    one all-gather re-gathering the input for the weight gradients. ``overlap_comm`` as in
    `ColumnParallelLinear`.

    ``dropout`` is applied to the output with `tp_dropout`: the same mask on every TP rank and at
    every TP size (a sequence share applies its rows of it), redrawn identically under activation
    checkpointing.
    ``init`` is the weights' initializer for all projections (biases follow nn.Linear's law for
    ``"torch"``, zeros otherwise).
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        activation: str = "gelu",
        *,
        dropout: float = 0.0,
        bias: bool = True,
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        init: InitSpec = "torch",
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"ParallelMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ParallelMLP: dropout must be in [0, 1), got {dropout}")
        self.d_model, self.d_hidden, self.activation, self.dropout = d_model, d_hidden, activation, float(dropout)
        self._setup_tp(tp_group)
        self.sequence_parallel, self.overlap_comm = bool(sequence_parallel), bool(overlap_comm)
        kw = dict(
            bias=bias, sequence_parallel=self.sequence_parallel, init=init, tp_group=self.tp_group,
            device=device, dtype=dtype,
        )
        if activation == "swiglu":
            self.gate = ColumnParallelLinear(d_model, d_hidden, overlap_comm=self.overlap_comm, **kw)
        else:
            self.register_module("gate", None)
        self.up = ColumnParallelLinear(d_model, d_hidden, overlap_comm=self.overlap_comm, **kw)
        self.down = RowParallelLinear(d_hidden, d_model, **kw)

    def _describe_shape(self) -> str:
        return f"d_model={self.d_model}, d_hidden={self.d_hidden}, activation={self.activation!r}"

    def extra_repr(self) -> str:
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"{self._describe_shape()}, dropout={self.dropout}, tp={self.tp_size}{sp}"

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        what = "this rank's share of the sequence" if self.sequence_parallel else "replicated on every TP rank"
        # The first floating-point tensor: int8 or sparse stand-ins for the projections hold buffers only.
        ref = next(t for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point())
        self._check_input(x, self.d_model, f"d_model, {what}", ref)
        shares = self._sequence_shares(x, seq_len) if self.sequence_parallel else None
        layers = [self.up] if self.gate is None else [self.up, self.gate]
        plain = [layer for layer in layers if type(layer) is ColumnParallelLinear]
        comm_cfg = ColumnComm(self.tp_group, shares, self.overlap_comm)
        entered = column_parallel_linear(x, [(p.weight, p.bias) for p in plain], comm_cfg) if plain else ()
        outputs = {id(layer): y if lora_settings(layer) is None else y + column_delta(layer, x, shares)
                   for layer, y in zip(plain, entered)}  # (low-rank adapters: `bigdense.layers.lora`)
        # A replacement (a `bd.low_rank` pair, which enters the region itself, with fewer features)
        # is called as a module.
        hidden, *gate = [outputs[id(layer)] if id(layer) in outputs else layer(x) for layer in layers]
        hidden = F.silu(gate[0]) * hidden if gate else _ELEMENTWISE[self.activation](hidden)
        return sequence_dropout(self.down(hidden), self.dropout, self.training, shares, self.tp_rank)

    # ---- the plain twin (`DenseTwin`): a `DenseMLP`, its projections the projections' own twins ----
    def _dense_twin(self) -> "DenseMLP":
        """With dropout off its forward equals this one's (in training its nn.Dropout draws its own masks)."""
        return DenseMLP(self.d_model, self.d_hidden, self.activation, dropout=self.dropout,
                        bias=getattr(self.down, "bias", None) is not None, device="meta")

    @classmethod
    def _check_dense(cls, module, method: str) -> None:
        if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("up", "down")):
            raise TypeError(f"{cls.__name__}.{method}: expected an MLP module with nn.Linear up and down (and gate), "
                            f"such as a DenseMLP; got {type(module).__name__}")

    @classmethod
    def _state_of(cls, module: nn.Module) -> dict[str, torch.Tensor]:
        return _projections_state({n: getattr(module, n) for n in ("gate", "up", "down")
                                   if getattr(module, n, None) is not None})

    @classmethod
    def from_dense(cls, *layers: nn.Module, activation: str | None = None, dropout: float | None = None, **kwargs):
        """This rank's slices of a plain PyTorch MLP.

        Either the two or three ``nn.Linear`` of the MLP, in the order they appear in the formula:
        ``from_dense(fc1, fc2, activation="gelu"|"relu")`` for ``fc2(act(fc1(x)))``,
        ``from_dense(gate, up, down, activation="swiglu")`` for ``down(silu(gate(x)) * up(x))``;
        or one module with attributes ``up``, ``down`` (and ``gate``) and ``activation``, such as
        `DenseMLP` / what `to_dense` returns. ``dropout`` defaults to 0 (to the module's p).
        ``kwargs``: ``tp_group``. Device and dtype are the linears'.
        """
        source = layers[0] if layers else None  # whose train/eval mode the MLP takes
        if len(layers) == 1 and hasattr(layers[0], "up") and hasattr(layers[0], "down"):
            module = layers[0]
            activation = activation or getattr(module, "activation", None)
            if dropout is None and isinstance(getattr(module, "dropout", None), nn.Dropout):
                dropout = module.dropout.p
            layers = (module.gate, module.up, module.down) if activation == "swiglu" else (module.up, module.down)
        activation = activation or "gelu"
        expected = 3 if activation == "swiglu" else 2
        if len(layers) != expected or not all(isinstance(layer, nn.Linear) for layer in layers):
            names = "(gate, up, down)" if activation == "swiglu" else "(fc1, fc2)"
            raise TypeError(
                f"ParallelMLP.from_dense(activation={activation!r}): expected {expected} nn.Linear {names}, "
                f"got {[type(layer).__name__ for layer in layers]}"
            )
        *ins, out = layers
        d_hidden, d_model = ins[0].out_features, ins[0].in_features
        for layer in ins:
            if (layer.out_features, layer.in_features) != (d_hidden, d_model):
                shapes = [tuple(linear.weight.shape) for linear in ins]
                raise ValueError(f"ParallelMLP.from_dense: the input projections differ in shape: {shapes}")
        if (out.out_features, out.in_features) != (d_model, d_hidden):
            raise ValueError(
                f"ParallelMLP.from_dense: output projection must be ({d_model}, {d_hidden}) "
                f"to follow ({d_hidden}, {d_model}), got {tuple(out.weight.shape)}"
            )
        has_bias = {layer.bias is not None for layer in layers}
        if len(has_bias) != 1:
            raise ValueError("ParallelMLP.from_dense: either every projection has a bias or none does")
        refuse_options(cls, kwargs, ("bias", "device", "dtype", "init"), "nn.Linear layers")
        mlp = cls(
            d_model, d_hidden, activation, dropout=dropout or 0.0, bias=has_bias.pop(),
            device="meta", dtype=ins[0].weight.dtype, **kwargs,
        )
        mlp.to_empty(device=ins[0].weight.device)
        names = ("gate", "up", "down") if activation == "swiglu" else ("up", "down")
        for name, layer in zip(names, layers):
            copy_flags(layer, getattr(mlp, name))
        return mlp.load_dense_(_projections_state(dict(zip(names, layers)))).train(source.training)


def _projections_state(projections: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``{"up.weight": ..., ...}``: the full tensors of an MLP's projections, by the MLP's names."""
    return {f"{name}.{key}": t for name, layer in projections.items() for key, t in layer.state_dict().items()}


class DenseMLP(nn.Module):
    """The unsharded MLP in plain PyTorch: ``down(act(up(x)))`` or ``down(silu(gate(x)) * up(x))``, dropout."""

    def __init__(
        self, d_model: int, d_hidden: int, activation: str = "gelu", *, dropout: float = 0.0, bias: bool = True,
        device=None, dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"DenseMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.gate = nn.Linear(d_model, d_hidden, **kw) if activation == "swiglu" else None
        self.up = nn.Linear(d_model, d_hidden, **kw)
        self.down = nn.Linear(d_hidden, d_model, **kw)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            hidden = F.silu(self.gate(x)) * self.up(x)
        else:
            hidden = _ELEMENTWISE[self.activation](self.up(x))
        return self.dropout(self.down(hidden))
