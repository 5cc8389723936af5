"""`parallelize`: turn the dense layers of an existing ``nn.Module`` into tensor-parallel ones, in place.

Module paths and parameter names do not change, so a parallelized model's checkpoints export to
(and import from) the original plain model's state dict.

What is converted automatically (``plan=None``), and why nothing else is:

* ``nn.Linear -> element-wise modules -> nn.Linear`` runs inside an ``nn.Sequential`` (any number
  of activations, ``nn.Dropout``, ``nn.Identity`` between them, or none): column, then row. Between the two the hidden
  features are sharded, which is exactly what element-wise modules tolerate, and so does a norm of
  each feature alone: an ``nn.BatchNorm1d``/``nn.SyncBatchNorm`` of those features between them
  becomes a `ShardedBatchNorm1d` (style ``per_feature``). A norm across the features (LayerNorm,
  RMSNorm, GroupNorm), a BatchNorm of other features or dims, or a softmax would not: such pairs are
  left alone (the report says which norm broke them).
* ``linear1``/``linear2`` of ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``. Their
  fused inference fast path (``torch._transformer_encoder_layer_fwd``) reads the weights directly,
  so it is switched off for converted layers (and nested-tensor conversion in their encoder).
* ``nn.Embedding`` with nn.Embedding's default options, unless its weight is tied to another
  module: the output of a `VocabParallelEmbedding` is the full embedding, a drop-in replacement.

A model of Hugging Face ``transformers`` that carries a tensor-parallel plan is converted by that
plan instead (`bigdense.parallelize.hf`: every style transformers defines, with corrections where a
model's own plan would train wrong); one that carries none is refused with ``plan=None`` (the
patterns above would miss its layers), naming them. Its ``Conv1D`` layers (GPT-2) convert as
column/row keeping their transposed weight layout (`ColumnParallelConv1D`).

Never automatic: a lone ``nn.Linear`` (a column layer would leave its output sharded, a gathered one
only adds communication); ``nn.MultiheadAttention``'s ``out_proj`` (it is applied inside
``F.multi_head_attention_forward``, which reads ``out_proj.weight`` whole -- refused even in a
plan); classifier heads (a `ParallelClassifierHead` returns this rank's shard of the logits, meant
for its ``loss``/``predict``: name it in a plan).

How an entry converts what it names: a plain ``nn.Linear``/``nn.Embedding`` (exactly that class,
its weight not shared) is replaced by bigdense's layer; anything else -- a subclass with its own
forward, an experts block, a norm, a parameter -- is converted in place
(`bigdense.parallelize.inplace`), keeping its class and forward. What stays whole, and why, is
reported (`ConversionReport`), never left silent.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch.nn as nn

from ..layers import (
    ColumnParallelConv1D, ColumnParallelLinear, RowParallelConv1D, RowParallelLinear, ShardedBatchNorm1d,
    ShardedDropout, tie_weights,
)
from ..layers.base import named_shard_specs
from ..layers.conv1d import is_conv1d
from ..layers.base import replace_module
from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..parallel.sharding import shard_range
from .hf import layer_pattern, unaligned_experts_to_eager, unnamed_layers_hint
from .inplace import ShardedInPlace, shard_in_place
from .plans import ELEMENTWISE, HF_SOURCE, TRANSFORMER_LAYERS, Conversion, Entry, PlanValue, plan_conversion
from .styles import Column, PerFeature, Row

logger = logging.getLogger("bigdense.parallelize")

CONV1D_LAYERS = {"column": ColumnParallelConv1D, "row": RowParallelConv1D}  # Hugging Face's transposed Linear


@dataclass
class ConversionReport:
    """What `parallelize` did: ``converted`` (``{name: style}``), ``dense`` (``{module or pattern:
    why it stays whole}``), the plan's ``unmatched`` patterns, and ``sharded_fraction``: the share
    of the model's parameters (elements, each counted once) that are split over TP."""

    source: str
    converted: dict[str, str] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)
    sharded_fraction: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self, model_name: str) -> str:
        lines = [f"parallelize: {model_name} by {self.source}: {len(self.converted)} modules/parameters converted, "
                 f"{self.sharded_fraction:.1%} of the parameters split over TP"]
        lines += [f"  stays whole: {name}: {why}" for name, why in sorted(self.dense.items())]
        if self.unmatched:
            lines.append(f"  plan patterns that match nothing in this model: {sorted(self.unmatched)}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def tp_plan(model: nn.Module, plan: Optional[Mapping[str, PlanValue]] = None) -> dict[str, str]:
    """The TP plan `parallelize` would apply: ``{module or parameter name: style}`` (nothing is
    changed); raises what `parallelize` would raise for a plan naming something it cannot convert.
    (Also importable as ``plan_parallelism``, its former name.)"""
    tp = comm.group_size(resolve_tp_group(None))
    return {name: e.style.name for name, e in plan_conversion(model, plan, tp).entries.items()}


def planned_splits(model: nn.Module, plan: Optional[Mapping[str, PlanValue]] = None,
                   tp: Optional[int] = None) -> dict[str, tuple[int, int]]:
    """``{parameter name: (split dim, packed blocks)}`` for the parameters `parallelize` would split
    (the planner counts a model before it is converted; Conv1D weights split as their layout says)."""
    tp = comm.group_size(resolve_tp_group(None)) if tp is None else tp
    conversion = plan_conversion(model, plan, tp)
    splits = {}
    for entry in conversion.entries.values():
        owner = model.get_submodule(entry.owner)
        for pname, p in owner.named_parameters(recurse=False):
            full = f"{entry.owner}.{pname}" if entry.owner else pname
            if entry.param is not None and entry.param != pname:
                continue
            if is_conv1d(owner) and entry.style.name in CONV1D_LAYERS:
                split = {"column": (1, 1), "row": (0, 1)}[entry.style.name] if pname == "weight" else (
                    (0, 1) if entry.style.name == "column" else None)
            else:
                split = entry.style.split(owner, pname, p, whole_module=entry.param is None)
            if split is not None:
                splits.setdefault(full, split)
    return splits


def parallelize(model: nn.Module, plan: Optional[Mapping[str, PlanValue]] = None, tp_group=None) -> nn.Module:
    """Convert ``model``'s dense layers for tensor parallelism, in place; returns ``model``.

    Call it on every TP rank with identical weights (same seed or same loaded state). ``plan``
    maps module- or parameter-name patterns (``fnmatch``: ``"blocks.*.mlp.fc1"``; ``*`` also
    crosses dots) to a style -- ``"column"``/``"row"`` (``nn.Linear``), ``"vocab"``
    (``nn.Embedding``), ``"head"`` (``nn.Linear`` -> `ParallelClassifierHead`), or any other style
    of `bigdense.parallelize.styles` (or its Hugging Face name) -- or to ``(style, {options})``,
    e.g. ``("column", {"gather_output": True})``, ``("row", {"input_is_parallel": False})``,
    ``("column", {"packed": 2})``. Every pattern must match a module or parameter. With
    ``plan=None`` the model's own Hugging Face plan is used, else the usual patterns are found (see
    the module docstring). ``nn.Dropout`` between a converted column/row pair becomes
    `ShardedDropout`. A weight two converted modules share stays shared.

    The conversion is logged (logger ``bigdense.parallelize``: a summary, with every module that
    stays whole and why, as a warning when under half of the parameters end up split) and
    recorded as ``model.bd_parallel_report`` (`ConversionReport`), ``model.bd_parallel_plan``
    (``{name: style}``) and ``model.bd_parallel_plan_source``; `tp_plan` previews it.
    """
    tp_group = resolve_tp_group(tp_group)
    conversion = plan_conversion(model, plan, comm.group_size(tp_group))
    logger.info("parallelize: using %s", conversion.source)
    originals = {name: model.get_submodule(e.owner) for name, e in conversion.entries.items()}
    in_place = _in_place_names(model, conversion)
    converted, split_done = {}, {}
    for name, entry in conversion.entries.items():
        where = f"{type(model).__name__}.{name}"
        if entry.owner in in_place:
            module = originals[name]
            if entry.param is None:
                entry.style.check_in_place(module, where)
            shard_in_place(module, tp_group, where, style=None if entry.param else entry.style,
                           splits=_splits(module, entry, conversion), shared=split_done)
            converted[name] = module
        else:
            converted[name] = _replace(model, name, entry, originals[name], tp_group)
        logger.info("parallelize: %s: %s -> %s", name or "<root>", type(originals[name]).__name__,
                    "in place" if entry.owner in in_place else type(converted[name]).__name__)
    for emb_name, head_name in conversion.ties:
        tie_weights(converted[emb_name], converted[head_name])
    _adapt_containers(model)
    conversion.notes += unaligned_experts_to_eager(model)
    model.bd_parallel_plan = {name: e.style.name for name, e in conversion.entries.items()}
    model.bd_parallel_plan_source = conversion.source
    model.bd_parallel_report = _report(model, conversion)
    return model


def _in_place_names(model: nn.Module, conversion: Conversion) -> set[str]:
    """Modules converted in place: every owner of a parameter entry, every module no bigdense layer
    replaces (`Style.replaces`; a Conv1D has its own), and every module holding a weight it shares
    with another (a replacing layer would untie it) unless a vocab embedding and a head are tied by
    `tie_weights`."""
    sharing = conversion.sharing - {m for pair in conversion.ties for m in pair}
    owners = {e.owner for e in conversion.entries.values() if e.param is not None}
    out = set()
    for name, entry in conversion.entries.items():
        module = model.get_submodule(entry.owner)
        replaced = entry.style.replaces(module) or (is_conv1d(module) and entry.style.name in CONV1D_LAYERS)
        if entry.param is not None or name in owners or name in sharing or not replaced:
            out.add(entry.owner)
    return out


def _splits(module: nn.Module, entry: Entry, conversion: Conversion) -> dict[str, tuple[int, int]]:
    """The parameters of ``module`` this entry splits: its own parameter, or (a module entry) every
    own parameter its style splits that has no entry of its own."""
    own = dict(module.named_parameters(recurse=False))
    if entry.param is not None:
        return {entry.param: entry.style.split(module, entry.param, own[entry.param], whole_module=False)}
    prefix = f"{entry.name}." if entry.name else ""
    splits = {}
    for pname, p in own.items():
        if prefix + pname in conversion.entries:
            continue
        split = entry.style.split(module, pname, p, whole_module=True)
        if split is not None:
            splits[pname] = split
    return splits


def _replace(model: nn.Module, name: str, entry: Entry, module: nn.Module, tp_group) -> nn.Module:
    """Replace ``module`` by the bigdense layer of its style (a Conv1D by its layout-keeping twin)."""
    if is_conv1d(module) and entry.style.name in CONV1D_LAYERS:
        new = CONV1D_LAYERS[entry.style.name].from_dense(module, tp_group=tp_group, **_conv1d_options(entry.style))
    else:
        new = entry.style.layer(module, tp_group)
    replace_module(model, name, new)
    return new


def _conv1d_options(style) -> dict:
    options = dict(style.layer_options)
    if isinstance(style, Column) and style.gather_output:
        options["gather_output"] = True
    if isinstance(style, Row) and not style.input_is_parallel:
        options["input_is_parallel"] = False
    return options


def _report(model: nn.Module, conversion: Conversion) -> ConversionReport:
    dense: dict[str, str] = {}
    for name, why in conversion.dense.items():  # layers collapse into one pattern: keep each distinct reason
        pattern, before = layer_pattern(name), dense.get(layer_pattern(name))
        dense[pattern] = why if before is None else before if why in before else f"{before}; {why}"
    report = ConversionReport(conversion.source, {n: e.style.describe() for n, e in conversion.entries.items()},
                              dense, list(conversion.unmatched), notes=list(conversion.notes))
    specs, seen, total, split = named_shard_specs(model), set(), 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        spec = specs.get(name)
        numel = math.prod(spec.global_shape) if spec is not None else p.numel()
        total += numel
        split += numel if spec is not None else 0
    report.sharded_fraction = split / total if total else 0.0
    for name, module in model.named_modules():  # plain dense layers nothing converted, by pattern
        if type(module) in (nn.Linear, nn.Embedding) or (is_conv1d(module) and not named_shard_specs(module)):
            report.dense.setdefault(layer_pattern(name), "not named by the plan")
    unnamed = sorted(p for p, why in report.dense.items() if why == "not named by the plan")
    if conversion.source == HF_SOURCE and unnamed and report.sharded_fraction < 0.5:
        report.notes.append(unnamed_layers_hint(type(model).__name__, unnamed, report.sharded_fraction))
    summary = report.summary(type(model).__name__)
    (logger.warning if report.sharded_fraction < 0.5 or report.notes else logger.info)(summary)
    return report


def _adapt_containers(model: nn.Module) -> None:
    """Dropout between a converted pair becomes `ShardedDropout`; transformer fast paths are disabled."""
    for _, module in list(model.named_modules()):  # (children are replaced below)
        if isinstance(module, TRANSFORMER_LAYERS) and isinstance(module.linear1, ColumnParallelLinear):
            # The fused fast path reads linear1/linear2 weights directly; the regular path calls them.
            module.activation_relu_or_gelu = 0
            if isinstance(module.linear2, RowParallelLinear) and isinstance(module.dropout, nn.Dropout):
                module.dropout = _sharded_dropout(module.dropout, module.linear1)
        elif isinstance(module, nn.TransformerEncoder):
            if any(isinstance(layer.linear1, ColumnParallelLinear) for layer in module.layers):
                module.use_nested_tensor = False
        elif isinstance(module, nn.Sequential):
            column = None
            for child_name, child in module.named_children():
                if isinstance(child, ColumnParallelLinear) and not child.gather_output:
                    column = child
                elif column is not None and type(child) is nn.Dropout:
                    setattr(module, child_name, _sharded_dropout(child, column))
                elif not (isinstance(child, ELEMENTWISE) or _per_feature(child)):
                    column = None


def _per_feature(module: nn.Module) -> bool:
    """A converted module acting on each feature alone: the features after it are still sharded."""
    return isinstance(module, ShardedBatchNorm1d) or (isinstance(module, ShardedInPlace)
                                                       and isinstance(module.bd_style, PerFeature))


def _sharded_dropout(dropout: nn.Dropout, column: ColumnParallelLinear) -> ShardedDropout:
    start, _ = shard_range(column.out_features, column.tp_size, column.tp_rank)
    return ShardedDropout(dropout.p, column.out_features, start)


plan_parallelism = tp_plan  # the former name
