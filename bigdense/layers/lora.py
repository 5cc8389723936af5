"""Low-rank adapters (LoRA) beside frozen dense layers, at any TP size: `add_lora`.

An adapted layer computes ``layer(x) + scaling * B(A(dropout(x)))`` (Hu et al. 2021; PEFT's
LoRA): ``A`` is (r, in_features), ``B`` (out_features, r), ``scaling`` is ``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA. ``B`` starts at zero, so an adapted model starts as its base;
``A`` by PEFT's rule, ``kaiming_uniform_(a=sqrt(5))`` = U(+-1/sqrt(in_features)), drawn counter-based
from the global shape (`bigdense.layers.init`), so the whole factor is the same at every TP size.
The factors are children of the layer they adapt, named as PEFT names them: ``<layer>.lora_A.weight``
and ``<layer>.lora_B.weight``.

How the factors are split over TP (PEFT's choice on transformers' tensor-parallel plans), so that
the adapter's output, gradients and initialisation are those of the unsharded model at every TP
size, and what each choice costs beside the layer's own communication:

* column layer (``W`` split by output features): ``A`` whole on every rank, ``B`` split by output
  like ``W`` (each packed block on its own: a fused ``[gate; up]`` or qkv weight keeps its layout).
  ``z = A x`` is computed on every rank (2 r in FLOPs per token, repeated), then enters the TP
  region: backward all-reduces its gradient, (tokens, r). Under sequence parallelism ``z`` of this
  rank's share is all-gathered along the sequence instead (forward all-gather, backward
  reduce-scatter of (tokens, r)) and ``A``'s gradient is partial over TP, summed like the
  sequence-parallel norms' (`bigdense.parallel.partial_grads`).
* row layer (``W`` split by input features): ``A`` split by input like ``W``, ``B`` whole. The
  partial products ``A_local x_local`` are all-reduced in forward, (tokens, r), and ``B z`` is added
  after the layer's own reduction. Under sequence parallelism they are reduce-scattered to this
  rank's share instead and ``B``'s gradient is partial over TP.
* a plain ``nn.Linear`` (or a Hugging Face ``Conv1D``) of a model not converted (tp=1): no
  communication.

So each adapted layer adds one collective of tokens x r elements per micro-batch (``r / in`` or
``r / out`` of the bytes the layer itself moves). Megatron-Bridge's other choice (``A`` split by
rank ``r`` and gathered) moves the same (tokens, r) per layer and splits ``A``'s small FLOPs.

``lora_dropout`` is bigdense's layout-free dropout (`tp_dropout`) on the adapter's input: the mask
the unsharded model draws, at any TP and DP size.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.autocast import autocast_dtype
from ..parallel.dropout import tp_dropout
from ..parallel.partial_grads import with_partial_grad
from ..parallel.regions import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence
from ..parallel.sharding import ShardSpec
from .base import TensorParallelModule, sequence_dropout
from .init import resolve_init

ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head


@dataclass(frozen=True)
class LoRASettings:
    """One adapter's hyper-parameters (PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``)."""

    r: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"add_lora: r must be a positive integer, got {self.r!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"add_lora: dropout must be in [0, 1), got {self.dropout}")
        if not self.alpha > 0:
            raise ValueError(f"add_lora: alpha must be > 0, got {self.alpha}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


@dataclass(frozen=True)
class Adapted:
    """How a layer takes an adapter: ``kind`` is ``"column"``, ``"row"`` or ``"plain"``; ``packed``
    the number of blocks its weight packs along the split dimension."""

    kind: str
    in_features: int
    out_features: int
    packed: int = 1


class LoRAFactor(TensorParallelModule):
    """One factor of an adapter, ``weight`` of global shape (out, in) as ``nn.Linear`` stores it,
    this rank's slice along ``split_dim`` (None: whole on every rank). ``partial_grad``: the
    adapter applies it to this rank's share of the sequence, so its gradient is partial over TP."""

    def __init__(self, global_shape: Sequence[int], split_dim: Optional[int], *, packed: int = 1, zero: bool,
                 tp_group=None, partial_grad: bool = False, device=None, dtype=None):
        super().__init__()
        self._setup_tp(tp_group if split_dim is not None or partial_grad else None)
        self.global_shape, self.zero, self.partial_grad = tuple(int(s) for s in global_shape), zero, partial_grad
        self.split_dim, self.packed = split_dim, packed
        spec = None if split_dim is None else ShardSpec.balanced(self.global_shape, split_dim, self.tp_size,
                                                                 self.tp_rank, packed)
        shape = self.global_shape if spec is None else spec.local_shape
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if split_dim is not None:
            self._declare_shard("weight", self.global_shape, split_dim, packed)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """B: zeros. A: U(+-1/sqrt(in)) of the global factor (PEFT's kaiming_uniform_(a=sqrt(5))),
        this rank's slice of it."""
        with torch.no_grad():
            if self.zero:
                self.weight.zero_()
                return
            full = torch.empty(self.global_shape, dtype=torch.float32, device=self.weight.device)
            resolve_init("torch", "lora_A").init_(full, self.global_shape, (0, 0), self._weight_seed)
            spec = self.shard_spec("weight")
            self.weight.copy_(full if spec is None else spec.slice_of(full))

    def bd_partial_grad_params(self) -> list:
        return [self.weight] if self.partial_grad and self.tp_size > 1 and self.weight.requires_grad else []

    def used(self) -> torch.Tensor:
        """The weight as the forward uses it: with its gradient summed over TP when partial."""
        return with_partial_grad(self.weight, self.tp_group) if self.partial_grad else self.weight

    def _describe_shape(self) -> str:
        return f"global {self.global_shape}"

    def extra_repr(self) -> str:
        split = "whole" if self.split_dim is None else f"split dim {self.split_dim}"
        return f"{self.global_shape[1]} -> {self.global_shape[0]}, {split}, tp={self.tp_size}"

    # ---- the plain twin: the nn.Linear(bias=False) PEFT holds ----
    _dense_kind = nn.Linear

    def _dense_twin(self) -> nn.Linear:
        out_f, in_f = self.global_shape
        return nn.Linear(in_f, out_f, bias=False, device="meta", dtype=self.weight.dtype)


# ---- which layers take an adapter, and how ----
def adapted_kind(module: nn.Module) -> Optional[Adapted]:
    """How ``module`` takes an adapter, or None when it cannot: bigdense's column and row layers
    (their ``lora_kind``),
    a module converted in place with a column or row style (its weight an ``nn.Linear``'s), and a
    plain ``nn.Linear`` or ``Conv1D`` not converted. Read by duck typing (no import of the
    converters: they stand above this floor)."""
    if isinstance(module, TensorParallelModule) and getattr(module, "lora_kind", None):
        return Adapted(module.lora_kind, module.in_features, module.out_features)
    style = getattr(module, "bd_style", None)
    if isinstance(module, nn.Linear) and getattr(style, "name", None) in ("column", "row"):
        return Adapted(style.name, module.in_features, module.out_features, int(getattr(style, "packed", 1)))
    if isinstance(module, nn.Linear) and style is None and not isinstance(module, TensorParallelModule):
        return Adapted("plain", module.in_features, module.out_features)
    if type(module).__name__ == "Conv1D" and getattr(module, "nx", None) and not hasattr(module, "bd_style"):
        return Adapted("plain", module.nx, module.nf)
    return None


def lora_settings(module: nn.Module) -> Optional[LoRASettings]:
    """The adapter settings of an adapted layer, else None."""
    return module.__dict__.get("lora_settings")


def attach_lora(layer: nn.Module, settings: LoRASettings, where: str) -> None:
    """Give ``layer`` an adapter (``lora_A``, ``lora_B``: see the module docstring for their split)."""
    kind = adapted_kind(layer)
    if kind is None:
        raise TypeError(f"add_lora: {where} is a {type(layer).__name__}, not a linear layer bigdense can adapt "
                        f"(a column or row layer, a module converted with a column or row style, or an nn.Linear)")
    if lora_settings(layer) is not None:
        raise ValueError(f"add_lora: {where} already has an adapter")
    if settings.dropout > 0 and kind.kind == "row" and kind.packed > 1:
        raise ValueError(f"add_lora: {where} is a packed row layer; its input features are not one slice of the "
                         f"layer's, so lora dropout cannot draw its slice of the mask: use dropout=0")
    weight = layer.weight
    options = dict(tp_group=getattr(layer, "tp_group", None), device=weight.device, dtype=weight.dtype)
    r, sp = settings.r, bool(getattr(layer, "sequence_parallel", False))
    a_split = 1 if kind.kind == "row" else None
    b_split = 0 if kind.kind == "column" else None
    layer.lora_A = LoRAFactor((r, kind.in_features), a_split, packed=kind.packed, zero=False,
                              partial_grad=sp and kind.kind == "column", **options)
    layer.lora_B = LoRAFactor((kind.out_features, r), b_split, packed=kind.packed, zero=True,
                              partial_grad=sp and kind.kind == "row", **options)
    layer.__dict__["lora_settings"] = settings


def detach_lora(layer: nn.Module) -> None:
    """Remove ``layer``'s adapter (after merging it, or to go back to the base)."""
    for name in ("lora_A", "lora_B"):
        if name in layer._modules:
            del layer._modules[name]
    layer.__dict__.pop("lora_settings", None)


# ---- the adapter's output, for each kind (called by the layers' forwards) ----
def _through(factor: LoRAFactor, x: torch.Tensor) -> torch.Tensor:
    """``x`` through one factor, in ``x``'s dtype (under autocast, autocast's, which casts both)."""
    weight = factor.used()
    return F.linear(x, weight.to(autocast_dtype(x.device.type, x.dtype)))


def column_delta(layer: nn.Module, x: torch.Tensor, seq_shares=None) -> torch.Tensor:
    """``scaling * B_local A dropout(x)``: this rank's output features of the adapter of a column
    layer; ``x`` as the layer takes it (replicated, or this rank's share of the sequence)."""
    settings = lora_settings(layer)
    z = _through(layer.lora_A, sequence_dropout(x, settings.dropout, layer.training, seq_shares,
                                                getattr(layer, "tp_rank", 0)))
    group = getattr(layer, "tp_group", None)
    z = copy_to_tp(z, group) if seq_shares is None else gather_from_sequence(z, group, list(seq_shares))
    return _through(layer.lora_B, z) * settings.scaling


def row_delta(layer: nn.Module, x_local: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``scaling * B A dropout(x)`` of a row layer, in its output's layout (replicated, or this
    rank's share of the sequence under sequence parallelism); ``x_local`` this rank's input
    features, from global feature ``start``."""
    settings = lora_settings(layer)
    x = tp_dropout(x_local, settings.dropout, layer.training, shard_dim=-1, global_size=layer.lora_A.global_shape[1],
                   offset=start) if settings.dropout > 0 else x_local
    z = _through(layer.lora_A, x)
    group = getattr(layer, "tp_group", None)
    z = reduce_scatter_to_sequence(z, group) if getattr(layer, "sequence_parallel", False) else reduce_from_tp(z, group)
    return _through(layer.lora_B, z) * settings.scaling


def plain_delta(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter of a layer that is not split: ``scaling * B A dropout(x)``."""
    settings = lora_settings(layer)
    return _through(layer.lora_B, _through(layer.lora_A, tp_dropout(x, settings.dropout, layer.training))) \
        * settings.scaling


def _plain_hook(layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted plain ``nn.Linear``/``Conv1D`` (whose forward bigdense does not own)."""
    return output + plain_delta(layer, args[0]) if lora_settings(layer) is not None else output


# ---- the public entry ----
def _matches(name: str, pattern: str) -> bool:
    """PEFT's rule for a ``target_modules`` entry (the whole name, or its last dotted parts), or a glob."""
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def output_heads(model: nn.Module) -> set[int]:
    """ids of the modules that produce a model's logits (never adapted by ``all-linear``, as in PEFT)."""
    heads = set()
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module):
            heads.add(id(head))
    return heads


def lora_targets(model: nn.Module, targets: Union[str, Iterable[str], None]) -> list[str]:
    """The names of ``model``'s modules ``targets`` selects: ``"all-linear"`` (or None), every
    linear layer bigdense can adapt except the output head; else the modules whose name matches a
    pattern (PEFT's ``target_modules`` rule: a whole name or its last dotted parts; or a glob).
    A pattern that matches nothing, or a module that cannot be adapted, is refused by name."""
    heads = output_heads(model)
    named = [(n, m) for n, m in model.named_modules() if n and not n.endswith(("lora_A", "lora_B"))]
    if targets is None or targets == ALL_LINEAR:
        chosen = [n for n, m in named if adapted_kind(m) is not None and id(m) not in heads]
        if not chosen:
            raise ValueError(f"add_lora: {type(model).__name__} has no linear layer to adapt")
        return chosen
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns:
        raise ValueError("add_lora: targets is empty; give module name patterns or 'all-linear'")
    chosen, unmatched = [], []
    for pattern in patterns:
        hits = [n for n, _ in named if _matches(n, pattern)]
        unmatched += [] if hits else [pattern]
        chosen += [n for n in hits if n not in chosen]
    if unmatched:
        raise ValueError(f"add_lora: targets {unmatched} match no module of {type(model).__name__} (a pattern is a "
                         f"module's whole name, its last dotted parts such as 'q_proj', or a glob)")
    refused = [f"{n} ({type(model.get_submodule(n)).__name__})" for n in chosen
               if adapted_kind(model.get_submodule(n)) is None]
    if refused:
        raise ValueError(f"add_lora: targets select modules that are not linear layers: {refused[:6]}; "
                         f"name the projections themselves")
    return chosen


def add_lora(model: nn.Module, r: int, alpha: float = None, targets: Union[str, Iterable[str], None] = ALL_LINEAR,
             dropout: float = 0.0, rslora: bool = False) -> nn.Module:
    """Give ``model``'s linear layers low-rank adapters and freeze everything else; returns ``model``.

    ``r``: the rank; ``alpha``: the scale's numerator (default ``r``: scaling 1); ``targets``:
    ``"all-linear"`` (every linear layer but the output head) or module name patterns (PEFT's
    ``target_modules``: ``["q_proj", "v_proj"]``, ``"layers.*.mlp.up"``); ``dropout``: the adapter
    input's dropout (layout-free); ``rslora``: scale by ``alpha / sqrt(r)``. Works on bigdense's
    column and row layers at any TP size (packed, uneven, sequence-parallel), on modules a plan
    converted in place, and on plain ``nn.Linear`` layers. Call it after the model is sharded (or
    built sharded) and its base weights are loaded; every rank calls it alike (the factors' seeds
    come from torch's generator). See the module docstring for the split and its cost.
    """
    settings = LoRASettings(int(r), float(r if alpha is None else alpha), float(dropout), bool(rslora))
    names = lora_targets(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        layer = model.get_submodule(name)
        attach_lora(layer, settings, name)
        if adapted_kind(layer).kind == "plain":
            layer.register_forward_hook(_plain_hook)
    return model


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: layer}`` of the layers of ``model`` that hold an adapter."""
    return {n: m for n, m in model.named_modules() if lora_settings(m) is not None}


def has_lora(model: nn.Module) -> bool:
    return any(lora_settings(m) is not None for m in model.modules())


def is_lora_name(name: str) -> bool:
    """A parameter name of an adapter factor."""
    return ".lora_A." in f".{name}" or ".lora_B." in f".{name}"


def cast_frozen_weights_(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Hold the adapted layers' frozen weights in ``dtype`` (bf16: half the base's bytes) while the
    adapters keep theirs; for a run under autocast in that dtype, which computes in it anyway.
    Returns the names cast."""
    cast = []
    for name, layer in adapted_layers(model).items():
        weight = layer.weight
        if not weight.requires_grad and weight.dtype != dtype:
            weight.data = weight.data.to(dtype)
            cast.append(f"{name}.weight")
    return cast


@torch.no_grad()
def merge_lora_(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight, shard by shard with no communication (a column
    layer's ``W_local += s B_local A``, a row layer's ``W_local += s B A_local``), and remove the
    adapters; returns ``model`` (its base weights changed)."""
    for name, layer in adapted_layers(model).items():
        settings = lora_settings(layer)
        delta = (layer.lora_B.weight.float() @ layer.lora_A.weight.float()) * settings.scaling
        _linear_view(layer).add_(delta.to(layer.weight.dtype))
        detach_lora(layer)
    return model


def _linear_view(layer: nn.Module) -> torch.Tensor:
    """``layer``'s weight as ``F.linear`` takes it, (out, in), a view of the stored one (a ``Conv1D``
    layout, converted or not, stores (in, out))."""
    if hasattr(layer, "_linear_weight"):
        return layer._linear_weight()
    return layer.weight.t() if type(layer).__name__ == "Conv1D" else layer.weight
