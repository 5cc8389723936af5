"""`parallelize`: turn the dense layers of an existing ``nn.Module`` into bigdense layers, in place.

Module paths and parameter names do not change, so a parallelized model's checkpoints export to
(and import from) the original plain model's state dict.

What is converted automatically (``plan=None``), and why nothing else is:

* ``nn.Linear -> element-wise modules -> nn.Linear`` runs inside an ``nn.Sequential`` (any number
  of activations, ``nn.Dropout``, ``nn.Identity`` between them, or none): column, then row. Between the two the hidden
  features are sharded, which is exactly what element-wise modules tolerate; a norm or softmax in
  between would not, so such pairs are left alone.
* ``linear1``/``linear2`` of ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``. Their
  fused inference fast path (``torch._transformer_encoder_layer_fwd``) reads the weights directly,
  so it is switched off for converted layers (and nested-tensor conversion in their encoder).
* ``nn.Embedding`` with nn.Embedding's default options, unless its weight is tied to another
  module: the output of a `VocabParallelEmbedding` is the full embedding, a drop-in replacement.

A model of Hugging Face ``transformers`` that carries a tensor-parallel plan
(``config.base_model_tp_plan`` and the class's ``_tp_plan``) is converted by that plan instead
(`bigdense.parallelize.hf`); one that carries none is refused with ``plan=None`` (the patterns below
would miss its layers), naming them. Its ``Conv1D`` layers (GPT-2) convert as column/row keeping
their transposed weight layout (`ColumnParallelConv1D`).

Never automatic: a lone ``nn.Linear`` (a column layer would leave its output sharded, a gathered one
only adds communication); ``nn.MultiheadAttention``'s ``out_proj`` (it is applied inside
``F.multi_head_attention_forward``, which reads ``out_proj.weight`` whole -- refused even in a
plan); classifier heads (a `ParallelClassifierHead` returns this rank's shard of the logits, meant
for its ``loss``/``predict``: name it in a plan).
"""
from __future__ import annotations

import fnmatch
import logging
import re
from typing import Mapping, Optional, Union

import torch.nn as nn

from ..layers import (
    ColumnParallelConv1D, ColumnParallelLinear, ParallelClassifierHead, RowParallelConv1D, RowParallelLinear,
    ShardedDropout, VocabParallelEmbedding, tie_weights,
)
from ..layers.conv1d import is_conv1d
from ..parallel.context import resolve_tp_group
from ..parallel.sharding import shard_range
from .hf import hf_tp_plan, is_hf_model, no_plan_error, translate_hf_plan

logger = logging.getLogger("bigdense.parallelize")

STYLES = {
    "column": ColumnParallelLinear, "row": RowParallelLinear, "vocab": VocabParallelEmbedding,
    "head": ParallelClassifierHead,
}
CONV1D_STYLES = {"column": ColumnParallelConv1D, "row": RowParallelConv1D}  # Hugging Face's transposed Linear
_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Identity, nn.Dropout,
)
_TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

PlanValue = Union[str, tuple]


def _is_attention_projection(model: nn.Module, name: str) -> bool:
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
    return isinstance(parent, nn.MultiheadAttention)


def _auto_plan(model: nn.Module) -> tuple[dict[str, tuple], dict[str, str]]:
    """``({name: (style, options)}, {name: why it stays dense})`` for the usual patterns."""
    plan, skipped = {}, {}
    shared = _shared_weights(model)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, _TRANSFORMER_LAYERS):
            if type(module.linear1) is nn.Linear and type(module.linear2) is nn.Linear:
                plan[prefix + "linear1"] = ("column", {})
                plan[prefix + "linear2"] = ("row", {})
        elif isinstance(module, nn.Sequential):
            children = list(module.named_children())
            i = 0
            while i < len(children):
                first = children[i][1]
                j = i + 1
                while j < len(children) and isinstance(children[j][1], _ELEMENTWISE):
                    j += 1
                if (type(first) is nn.Linear and j < len(children) and type(children[j][1]) is nn.Linear
                        and children[j][1].in_features == first.out_features):
                    plan[prefix + children[i][0]] = ("column", {})
                    plan[prefix + children[j][0]] = ("row", {})
                    i = j + 1
                else:
                    i += 1
        elif type(module) is nn.Embedding:
            if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
                skipped[name] = "nn.Embedding with max_norm/sparse/scale_grad_by_freq"
            elif id(module.weight) in shared:
                skipped[name] = (f"weight shared by {shared[id(module.weight)]}; "
                                 f"name a tied pair in a plan (vocab + head)")
            else:
                plan[name] = ("vocab", {})
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in plan:
            skipped[name] = ("nn.MultiheadAttention projection, applied by F.multi_head_attention_forward"
                             if _is_attention_projection(model, name) else "no column->row partner")
    return plan, skipped


def _shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """``{id(weight): [module names]}`` for weights reachable through more than one module name
    (tied weights, or one module used in two places)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners.setdefault(id(w), []).append(name)
    return {k: v for k, v in owners.items() if len(v) > 1}


def _normalise(value: PlanValue, pattern: str) -> tuple[str, dict]:
    style, options = (value, {}) if isinstance(value, str) else (value[0], dict(value[1]) if len(value) > 1 else {})
    if style not in STYLES:
        raise ValueError(f"parallelize: plan[{pattern!r}] = {style!r}; the styles are {sorted(STYLES)}")
    return style, options


def _resolve_plan(model: nn.Module, plan: Mapping[str, PlanValue], hf: bool = False) -> dict[str, tuple]:
    """``{module name: (style, options)}``. A Hugging Face plan (``hf``) is matched as transformers
    matches it (``*`` stands for a layer number), and a pattern matching no module is skipped (a
    model's own plan may name modules some variants lack); otherwise that is an error."""
    names = [n for n, _ in model.named_modules()]
    resolved: dict[str, tuple] = {}
    for pattern, value in plan.items():
        style, options = _normalise(value, pattern)
        if hf:
            hits = [n for n in names if re.sub(r"\d+", "*", n) == pattern]
        else:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and hf:
            logger.info("parallelize: plan pattern %r matches no module of this model", pattern)
        elif not hits:
            raise ValueError(
                f"parallelize: plan pattern {pattern!r} matches no module (module names look like {names[1:4]})"
            )
        for name in hits:
            if name in resolved and resolved[name][0] != style:
                raise ValueError(f"parallelize: module {name!r} is matched as {resolved[name][0]!r} and as {style!r}")
            resolved[name] = (style, options)
    return resolved


def _check_convertible(model: nn.Module, name: str, style: str) -> None:
    module = model.get_submodule(name)
    want = nn.Embedding if style == "vocab" else nn.Linear
    if style in CONV1D_STYLES and is_conv1d(module):
        return
    if not isinstance(module, want) or isinstance(module, tuple(STYLES.values())):
        raise TypeError(
            f"parallelize: {name!r} is a {type(module).__name__}; style {style!r} converts an {want.__name__}"
        )
    if style != "vocab" and _is_attention_projection(model, name):
        raise ValueError(
            f"parallelize: {name!r} is nn.MultiheadAttention's output projection; F.multi_head_attention_forward "
            f"reads its weight whole, so it cannot be sharded (use a bigdense attention block instead)"
        )


def tp_plan(model: nn.Module, plan: Optional[Mapping[str, PlanValue]] = None) -> dict[str, str]:
    """The TP plan `parallelize` would apply: ``{module name: style}`` (nothing is changed); raises
    what `parallelize` would raise for a plan naming a module it cannot convert. (Also importable
    as ``plan_parallelism``, its former name.)"""
    resolved = _choose_plan(model, plan)[0]
    for name, (style, _) in resolved.items():
        _check_convertible(model, name, style)
    return {name: style for name, (style, _) in resolved.items()}


def _choose_plan(model: nn.Module, plan: Optional[Mapping[str, PlanValue]]) -> tuple[dict[str, tuple], str]:
    """The resolved plan and where it came from: the one given, the model's own Hugging Face plan,
    or the automatic patterns."""
    if plan is not None:
        return _resolve_plan(model, plan), "the plan given"
    hf = hf_tp_plan(model)
    if hf is not None:
        return _without_tied(model, _resolve_plan(model, translate_hf_plan(hf), hf=True)), \
            "the model's Hugging Face tensor-parallel plan"
    if is_hf_model(model):
        raise no_plan_error(model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)])
    resolved, skipped = _auto_plan(model)
    for name, why in skipped.items():
        logger.info("parallelize: %s stays dense: %s", name or "<root>", why)
    return resolved, "the automatic plan"


def _without_tied(model: nn.Module, resolved: dict[str, tuple]) -> dict[str, tuple]:
    """A Hugging Face plan shards a tied embedding and output layer as embedding + gathered column;
    bigdense ties a vocab embedding to a `ParallelClassifierHead` only, so such a pair stays dense."""
    shared = _shared_weights(model)
    kept = dict(resolved)
    for name in resolved:
        partners = shared.get(id(getattr(model.get_submodule(name), "weight", None)), [])
        if partners:
            logger.info("parallelize: %s stays dense: its weight is tied to %s", name, [p for p in partners if p != name])
            kept.pop(name, None)
    return kept


def parallelize(model: nn.Module, plan: Optional[Mapping[str, PlanValue]] = None, tp_group=None) -> nn.Module:
    """Replace dense layers of ``model`` by bigdense layers holding this rank's slices; returns ``model``.

    Call it on every TP rank with identical weights (same seed or same loaded state). ``plan``
    maps module-name patterns (``fnmatch``: ``"blocks.*.mlp.fc1"``; ``*`` also crosses dots) to a
    style -- ``"column"``/``"row"`` (``nn.Linear``), ``"vocab"`` (``nn.Embedding``), ``"head"``
    (``nn.Linear`` -> `ParallelClassifierHead`) -- or to ``(style, {constructor options})``, e.g.
    ``("column", {"gather_output": True})`` or ``("row", {"input_is_parallel": False})``. Every
    pattern must match a module. With ``plan=None`` the usual patterns are found (see the module
    docstring). ``nn.Dropout`` between a converted column/row pair becomes `ShardedDropout`.
    A vocab embedding and a head whose weights were tied stay tied.

    With ``plan=None`` a Hugging Face model that carries a tensor-parallel plan is converted by it:
    ``colwise`` -> column, ``rowwise`` -> row, ``colwise_gather_output`` -> column with
    ``gather_output=True``, ``embedding_rowwise`` -> vocab; any other style is refused, as is a
    transformers model that carries no plan. A ``Conv1D`` (GPT-2) converts as column/row with its
    own weight layout.

    The conversion is logged (logger ``bigdense.parallelize``) and recorded as
    ``model.bd_parallel_plan`` (``{name: style}``) and ``model.bd_parallel_plan_source`` (which
    plan was used); `tp_plan` previews it.
    """
    tp_group = resolve_tp_group(tp_group)
    resolved, source = _choose_plan(model, plan)
    logger.info("parallelize: using %s", source)
    for name, (style, _) in resolved.items():
        _check_convertible(model, name, style)
    shared = _shared_weights(model)
    originals = {name: model.get_submodule(name) for name in resolved}
    ties = []
    for name, module in originals.items():
        partners = shared.get(id(module.weight))
        if partners is None:
            continue
        partner_names = [p for p in partners if p != name]
        styles = {resolved.get(p, (None,))[0] for p in partner_names} | {resolved[name][0]}
        if styles != {"vocab", "head"} or len(partner_names) != 1:
            raise ValueError(
                f"parallelize: {name}.weight is shared with {partner_names}; convert a tied pair as 'vocab' + 'head' "
                f"(got styles {sorted(s or 'dense' for s in styles)})"
            )
        if resolved[name][0] == "vocab":
            ties.append((name, partner_names[0]))

    converted = {}
    for name, (style, options) in resolved.items():
        classes = CONV1D_STYLES if is_conv1d(originals[name]) else STYLES
        new = classes[style].from_dense(originals[name], tp_group=tp_group, **options)
        converted[name] = new
        if name == "":
            model = new
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        logger.info("parallelize: %s: %s -> %s", name or "<root>", type(originals[name]).__name__, type(new).__name__)
    for emb_name, head_name in ties:
        tie_weights(converted[emb_name], converted[head_name])
    _adapt_containers(model)
    model.bd_parallel_plan = {name: style for name, (style, _) in resolved.items()}
    model.bd_parallel_plan_source = source
    return model


def _adapt_containers(model: nn.Module) -> None:
    """Dropout between a converted pair becomes `ShardedDropout`; transformer fast paths are disabled."""
    for _, module in list(model.named_modules()):  # (children are replaced below)
        if isinstance(module, _TRANSFORMER_LAYERS) and isinstance(module.linear1, ColumnParallelLinear):
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
                elif not isinstance(child, _ELEMENTWISE):
                    column = None


def _sharded_dropout(dropout: nn.Dropout, column: ColumnParallelLinear) -> ShardedDropout:
    start, _ = shard_range(column.out_features, column.tp_size, column.tp_rank)
    return ShardedDropout(dropout.p, column.out_features, start)


plan_parallelism = tp_plan  # the former name
