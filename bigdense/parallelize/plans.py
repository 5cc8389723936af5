"""Which plan converts a model, and what each of its entries names: `plan_conversion`.

The plan is the one given, else the model's own Hugging Face plan (`bigdense.parallelize.hf`), else
the automatic patterns (`auto_plan`). Its patterns are matched against the model's module and
parameter names; every entry becomes a `Style` (`bigdense.parallelize.styles`) checked against what
it names, and a weight two modules share is followed to both. The result, a `Conversion`, says
what will be converted and what stays whole and why; nothing is changed here.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..layers.conv1d import is_conv1d
from ..layers.feature_norm import NORMS, per_feature_refusal
from .hf import (
    HF_STYLES, apply_fixes, dropout_notes, expert_entries, hf_expert_plan, hf_tp_plan, is_hf_model, layer_pattern,
    no_plan_error, per_head_norms, resolve_options, translate_hf_plan, undividable_heads,
)
from .styles import STYLES, Column, Head, Row, Style, StyleError, make_style

PlanValue = Union[str, tuple]
HF_SOURCE = "the model's Hugging Face tensor-parallel plan"  # Conversion.source of a model's own plan

ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Identity, nn.Dropout,
)
TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


@dataclass
class Entry:
    """One converted name: a module (its style acts on its forward and its own parameters) or a
    parameter (``param`` set: only split)."""

    name: str
    style: Style
    param: Optional[str] = None  # the parameter's own name when the entry names a parameter

    @property
    def owner(self) -> str:
        return self.name.rpartition(".")[0] if self.param else self.name


@dataclass
class Conversion:
    """What `parallelize` will do: ``entries`` by name, ``dense`` (``{name: why it stays whole}``),
    ``unmatched`` plan patterns (of a model's own plan: parts this variant of it lacks)."""

    source: str
    entries: dict[str, Entry]
    dense: dict[str, str] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)
    ties: list[tuple[str, str]] = field(default_factory=list)  # (vocab embedding, head) tied by `tie_weights`
    sharing: set[str] = field(default_factory=set)  # modules holding a parameter another module holds too
    notes: list[str] = field(default_factory=list)  # what the converted model does differently (its dropout)


def _is_attention_projection(model: nn.Module, name: str) -> bool:
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
    return isinstance(parent, nn.MultiheadAttention)


def shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): [its full names]}`` for parameters reachable under more than one name
    (tied weights, or one module used in two places)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return {k: v for k, v in owners.items() if len(v) > 1}


def auto_plan(model: nn.Module) -> tuple[dict[str, tuple], dict[str, str]]:
    """``({name: (style, options)}, {name: why it stays whole})`` for the usual patterns (see
    `bigdense.parallelize.convert`'s docstring)."""
    plan, skipped = {}, {}
    shared = {n.rpartition(".")[0] for names in shared_parameters(model).values() for n in names}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, TRANSFORMER_LAYERS):
            if type(module.linear1) is nn.Linear and type(module.linear2) is nn.Linear:
                plan[prefix + "linear1"] = ("column", {})
                plan[prefix + "linear2"] = ("row", {})
        elif isinstance(module, nn.Sequential):
            _sequential_pairs(list(module.named_children()), prefix, plan, skipped)
        elif type(module) is nn.Embedding:
            if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
                skipped[name] = "nn.Embedding with max_norm/sparse/scale_grad_by_freq"
            elif name in shared:
                skipped[name] = "its weight is shared with another module; name a tied pair in a plan (vocab + head)"
            else:
                plan[name] = ("vocab", {})
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in plan:
            skipped.setdefault(name, "nn.MultiheadAttention projection, applied by F.multi_head_attention_forward"
                               if _is_attention_projection(model, name) else "no column->row partner")
    return plan, skipped


def _sequential_pairs(children: list[tuple[str, nn.Module]], prefix: str, plan: dict, skipped: dict) -> None:
    """The column -> row pairs among an ``nn.Sequential``'s children into ``plan``: an ``nn.Linear``,
    element-wise modules and norms of each feature alone (`per_feature_refusal`: those become
    ``per_feature``), an ``nn.Linear`` taking its outputs. A pair that a norm across the features (or
    a BatchNorm of other features) would break is recorded in ``skipped``, with why."""
    i = 0
    while i < len(children):
        name, first = children[i]
        j = i + 1
        while j < len(children) and isinstance(children[j][1], ELEMENTWISE + NORMS):
            j += 1
        partner = children[j] if j < len(children) else None
        if (type(first) is not nn.Linear or partner is None or type(partner[1]) is not nn.Linear
                or partner[1].in_features != first.out_features):
            i += 1
            continue
        norms = [(n, m) for n, m in children[i + 1:j] if isinstance(m, NORMS)]
        blocked = [(n, why) for n, m in norms if (why := per_feature_refusal(m, first.out_features)) is not None]
        if blocked:
            skipped[prefix + name] = (f"its column -> row pair with {prefix + partner[0]} is broken by "
                                      f"{prefix + blocked[0][0]}: {blocked[0][1]}")
            i += 1
            continue
        plan[prefix + name] = ("column", {})
        plan.update({prefix + n: ("per_feature", {}) for n, _ in norms})
        plan[prefix + partner[0]] = ("row", {})
        i = j + 1


def _normalise(value: PlanValue, pattern: str, model: nn.Module) -> tuple[str, dict]:
    """``(bigdense style, options)`` of a plan value: a style name (bigdense's or Hugging Face's,
    whose options the model's config may give: a head's width) or ``(style, {options})``."""
    name, options = (value, {}) if isinstance(value, str) else (value[0], dict(value[1]) if len(value) > 1 else {})
    if name in HF_STYLES and not isinstance(value, tuple):
        style, hf_options = HF_STYLES[name]
        return style, resolve_options(hf_options, model, f"plan[{pattern!r}] ({name})")
    return name, options


def _match(model: nn.Module, plan: Mapping[str, tuple], hf: bool) -> tuple[dict[str, tuple], list[str]]:
    """``({module or parameter name: (style, options)}, patterns matching nothing)``. A Hugging Face
    plan is matched as transformers matches it (`layer_pattern`), any other with ``fnmatch`` (``*``
    also crosses dots)."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    resolved, unmatched = {}, []
    for pattern, (style, options) in plan.items():
        hits = [n for n in names if (layer_pattern(n) == pattern if hf else fnmatch.fnmatchcase(n, pattern))]
        if not hits:
            unmatched.append(pattern)
        for name in hits:
            if name in resolved and resolved[name][0] != style:
                raise ValueError(f"parallelize: {name!r} is matched as {resolved[name][0]!r} and as {style!r}")
            resolved[name] = (style, options)
    return resolved, unmatched


def _entry(model: nn.Module, name: str, style_name: str, options: dict, tp: int) -> Entry:
    """The checked entry for ``name`` (a module or a parameter) at TP size ``tp``."""
    try:
        style = make_style(style_name, options, where=f"parallelize: plan[{name!r}]")
    except StyleError as err:
        raise ValueError(f"{err} (the styles are {sorted(STYLES)})") from None
    params = dict(model.named_parameters())
    if name in params and name not in dict(model.named_modules()):
        if not style.splits_parameters or getattr(style, "unit", 1) > 1:
            splitting = sorted(n for n, cls in STYLES.items() if cls.splits_parameters)
            raise ValueError(f"parallelize: {name!r} is a parameter; only {splitting} (without unit) split a "
                             f"parameter (got {style.describe()!r})")
        return Entry(name, style, param=name.rpartition(".")[2])
    module = model.get_submodule(name)
    _check_module(model, name, module, style)
    try:
        style.check_tp(module, f"parallelize: {name!r}", tp)
    except StyleError as err:
        raise ValueError(str(err)) from None
    return Entry(name, style)


def _check_expert_parameters(entries: dict[str, Entry]) -> None:
    """A parameter split by expert must sit below an experts module converted as such: its forward
    maps the routes to this rank's experts."""
    experts = [n for n, e in entries.items() if e.style.name == "experts"]
    for name, entry in entries.items():
        if entry.style.name == "by_expert" and not any(name.startswith(m + ".") for m in experts):
            raise ValueError(f"parallelize: {name!r} is split by expert ('by_expert'), but no module above it is "
                             f"converted as 'experts' (which routes each token to this rank's experts); name it")


def _check_module(model, name: str, module: nn.Module, style: Style) -> None:
    where = f"parallelize: {name!r}"
    if isinstance(module, TensorParallelModule):
        raise TypeError(f"{where} is already a bigdense layer ({type(module).__name__})")
    if isinstance(style, (Column, Row, Head)) and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TypeError(f"{where} is a {type(module).__name__}; style {style.name!r} converts an Linear")
    if isinstance(style, (Row, Column, Head)) and _is_attention_projection(model, name):
        raise ValueError(
            f"{where} is nn.MultiheadAttention's output projection; F.multi_head_attention_forward "
            f"reads its weight whole, so it cannot be sharded (use a bigdense attention block instead)"
        )
    try:
        style.check(module, where)
    except StyleError as err:
        raise TypeError(str(err)) from None


def _follow_ties(model: nn.Module, shared: dict[int, list[str]], entries: dict[str, Entry], hf: bool,
                 dense: dict[str, str]) -> list[tuple]:
    """Check every weight two modules share: a vocab embedding and a head are tied by
    `tie_weights` (returned); otherwise every holder must be converted, the same way, in place. A
    Hugging Face plan that names only one holder keeps it whole (recorded in ``dense``); a plan
    given is refused."""
    ties = []
    for names in shared.values():
        holders = {n.rpartition(".")[0]: n for n in names}
        named = {m: entries.get(m) or entries.get(p) for m, p in holders.items()}
        if not any(named.values()):
            continue
        styles = {m: e.style.name if e else None for m, e in named.items()}
        if set(styles.values()) == {"vocab", "head"} and len(holders) == 2:
            ties.append(tuple(m for s in ("vocab", "head") for m, st in styles.items() if st == s))
            continue
        if all(named.values()):
            continue  # converted in place together; `shard_in_place` checks they split it alike
        first = next(m for m, e in named.items() if e)
        others = sorted(m for m in holders if m != first)
        if not hf:
            raise ValueError(
                f"parallelize: {first}.weight is shared with {others}; name every module that holds it in the plan "
                f"(the same split), or convert a tied pair as 'vocab' + 'head' (got styles "
                f"{sorted(s or 'dense' for s in styles.values())})")
        for m, e in named.items():
            if e:
                entries.pop(e.name)
                dense[e.name] = f"its weight is tied to {[o for o in holders if o != m]}, which the plan leaves whole"
    return ties


def _from_hf_plan(model: nn.Module, hf_plan: Mapping[str, str], tp: int) -> tuple[dict, list, dict, list]:
    """``(resolved, unmatched patterns, {name: why it stays whole}, notes)`` of a model's own plan at
    TP size ``tp`` (`bigdense.parallelize.hf`): its tensor-parallel entries, corrected; the experts
    its expert-parallel plan splits that those leave whole; attention whose heads do not divide kept
    whole; the per-head norms it leaves out of split attention added."""
    resolved, unmatched = _match(model, translate_hf_plan(hf_plan, model), hf=True)
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    resolved, dense = apply_fixes(model, resolved, names)
    from_ep_plan, _ = _match(model, translate_hf_plan(hf_expert_plan(model), model), hf=True)
    experts, whole, notes = expert_entries(model, resolved, from_ep_plan, tp)
    resolved.update(experts)
    dense.update(whole)
    for name, why in undividable_heads(model, resolved, tp).items():
        resolved.pop(name)
        dense[name] = why
    norms, norm_notes = per_head_norms(model, resolved)
    resolved.update(norms)
    return resolved, unmatched, dense, notes + norm_notes + dropout_notes(model, resolved)


def plan_conversion(model: nn.Module, plan: Optional[Mapping[str, PlanValue]], tp: int) -> Conversion:
    """What `parallelize` would do to ``model`` at TP size ``tp`` (see the module docstring)."""
    hf_plan = hf_tp_plan(model) if plan is None else None
    if plan is not None:
        source = "the plan given"
        raw = {pattern: _normalise(value, pattern, model) for pattern, value in plan.items()}
        resolved, unmatched = _match(model, raw, hf=False)
        if unmatched:
            names = [n for n, _ in model.named_modules()]
            raise ValueError(f"parallelize: plan pattern {unmatched[0]!r} matches no module "
                             f"(module names look like {names[1:4]})")
        dense, notes = {}, []
    elif hf_plan is not None:
        source = HF_SOURCE
        resolved, unmatched, dense, notes = _from_hf_plan(model, hf_plan, tp)
    elif is_hf_model(model):
        raise no_plan_error(model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)])
    else:
        source = "the automatic plan"
        resolved, dense = auto_plan(model)
        unmatched, notes = [], []
    entries = {name: _entry(model, name, style, options, tp) for name, (style, options) in resolved.items()}
    _check_expert_parameters(entries)
    shared = shared_parameters(model)
    conversion = Conversion(source, entries, dense, unmatched, notes=notes,
                            sharing={n.rpartition(".")[0] for names in shared.values() for n in names})
    conversion.ties = _follow_ties(model, shared, entries, hf=plan is None and hf_plan is not None, dense=dense)
    return conversion

