"""The tensor-parallel plans Hugging Face ``transformers`` models carry, as `parallelize` plans.

A transformers model declares how to shard it: ``config.base_model_tp_plan`` for the base model
(Llama: ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``),
the model class's ``_tp_plan`` for what wraps it (``{"lm_head": "colwise_gather_output"}``), and an
``embed_tokens: embedding_rowwise`` transformers adds; it merges them into the instance's
``_tp_plan`` under full module names. Patterns match module *and* parameter names, a ``*`` standing
for a layer number (``layers.*.mlp.experts.gate_up_proj`` names a parameter: only split it). Its
expert-parallel plan (``base_model_ep_plan``, ``_ep_plan``) is built the same way.

Every style transformers defines (``transformers/distributed/tensor_parallel.py``, and the two
expert-parallel ones of ``expert_parallel.py``) has its meaning here as a bigdense style
(`HF_STYLES`; what each does is `bigdense.parallelize.styles`). Experts that the tensor-parallel
plan leaves whole and the expert-parallel plan splits are split by the latter (`expert_entries`:
transformers 5.25 moved most models' experts there). Where a model's own plan would train wrong,
bigdense corrects it or keeps the affected modules whole, and says why (`PLAN_FIXES`; per-head
norms a plan leaves out, `per_head_norms`); attention whose heads do not divide over the TP group
stays whole (`undividable_heads`). transformers itself is not imported here.
"""
from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Mapping, Optional


@dataclass(frozen=True)
class FromConfig:
    """A style option whose value is the model's (text) config's, read when its plan is translated."""

    what: str  # what is read, for messages
    read: Callable[[object], int]


# transformers' own rule for the size of a unit of `unit_colwise`/`unit_rowwise` (one attention head).
HEAD_DIM = FromConfig("head_dim", lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
ROPE_DIM = FromConfig("qk_rope_head_dim", lambda c: int(getattr(c, "qk_rope_head_dim", 0) or 0))

# Hugging Face style -> (bigdense style, options)
HF_STYLES = {
    "colwise": ("column", {}),
    "colwise_gather_output": ("column", {"gather_output": True}),
    "colwise_rep": ("column", {"gather_output": True}),
    # transformers 5.25: a column split in whole heads (k/v of MiniCPM5-MoE); where heads do not divide,
    # transformers holds a head on several ranks, bigdense keeps the attention whole (`undividable_heads`).
    "unit_colwise": ("column", {"unit": HEAD_DIM}),
    "rowwise": ("row", {}),
    "unit_rowwise": ("row", {"unit": HEAD_DIM}),  # transformers 5.25: the output projection of such heads
    "rowwise_split_input": ("row", {"input_is_parallel": False}),
    "rowwise_rep": ("row", {"input_is_parallel": False}),
    "packed_colwise": ("column", {"packed": 2}),  # [gate; up]: each half split on its own
    "packed_rowwise": ("row", {"packed": 2}),
    "embedding_rowwise": ("vocab", {}),
    "embedding_colwise": ("embedding_dim", {}),
    "replicated_with_grad_allreduce": ("partial_grad", {}),
    "sequence_parallel": ("sequence", {}),
    "all_reduce": ("partial_output", {}),
    "moe_tp_experts": ("partial_output", {}),  # hidden states and routing weights in, a partial sum out
    "moe_identity_expert": ("divide_input", {}),  # transformers <= 5.24 (LongCat-Flash's identity experts)
    "mla_kv_a_proj": ("mla_kv_a", {"rope_dim": ROPE_DIM}),
    "local_params": ("local", {}),
    "replicate": ("replicate", {}),
    # Expert parallelism's styles (an expert-parallel plan), over the TP group: whole experts per rank.
    "ep_dispatch_experts": ("experts", {}),
    "grouped_gemm": ("by_expert", {}),
}
EXPERT_STYLES = ("ep_dispatch_experts", "grouped_gemm")  # what `expert_entries` takes from an expert-parallel plan


def transformers_version() -> str:
    """The installed transformers' version (read from its metadata: nothing is imported)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "not installed"


def layer_pattern(name: str) -> str:
    """``model.layers.3.mlp.w1`` -> ``model.layers.*.mlp.w1``: the layer numbers (dotted numeric
    segments) become ``*``, as transformers matches plans; digits inside a name stay."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _hf_plan(model, kind: str) -> Optional[dict[str, str]]:
    """``{module pattern: Hugging Face style}`` of the model's ``kind`` plan (``tp`` or ``ep``), or
    None if it carries none: the instance's merged ``_{kind}_plan``, else the class's and the
    config's ``base_model_{kind}_plan`` under the base model's prefix."""
    merged = getattr(model, f"_{kind}_plan", None)
    if isinstance(merged, Mapping) and merged:
        return dict(merged)
    plan = dict(getattr(type(model), f"_{kind}_plan", None) or {})
    base = getattr(getattr(model, "config", None), f"base_model_{kind}_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        wrapped = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
        plan.update({(f"{prefix}." if wrapped else "") + pattern: style for pattern, style in base.items()})
    return plan or None


def hf_tp_plan(model) -> Optional[dict[str, str]]:
    """``{module pattern: Hugging Face style}`` that ``model`` carries, or None if it carries none."""
    return _hf_plan(model, "tp")


def hf_expert_plan(model) -> dict[str, str]:
    """The entries of ``model``'s expert-parallel plan that split experts (`EXPERT_STYLES`)."""
    return {pattern: style for pattern, style in (_hf_plan(model, "ep") or {}).items() if style in EXPERT_STYLES}


def text_config(model):
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def resolve_options(options: Mapping, model, where: str) -> dict:
    """``options`` with every `FromConfig` value read from ``model``'s text config."""
    out = dict(options)
    for key, value in options.items():
        if isinstance(value, FromConfig):
            try:
                out[key] = value.read(text_config(model))
            except Exception as err:  # noqa: BLE001 - a foreign config: missing, or per layer (a RuntimeError)
                raise ValueError(f"parallelize: {where}: option {key!r} is the model config's {value.what}, which "
                                 f"cannot be read ({type(err).__name__}: {err}); give it: (style, {{{key!r}: ...}})"
                                 ) from None
    return out


def translate_hf_plan(plan: Mapping[str, str], model=None) -> dict[str, tuple]:
    """The same plan in bigdense styles; a style transformers does not define is refused, naming it."""
    refused = {pattern: style for pattern, style in plan.items() if style not in HF_STYLES}
    if refused:
        raise ValueError(
            f"parallelize: the model's Hugging Face tensor-parallel plan uses styles bigdense does not know: "
            f"{refused} (transformers {transformers_version()} installed); known: {sorted(HF_STYLES)}. Pass plan= "
            f"naming the modules to convert"
        )
    out = {}
    for pattern, hf_style in plan.items():
        style, options = HF_STYLES[hf_style]
        out[pattern] = (style, resolve_options(options, model, f"plan[{pattern!r}] ({hf_style})"))
    return out


@dataclass(frozen=True)
class PlanFix:
    """A model's own plan that would train wrong, and what bigdense does instead: ``entries`` maps
    a module-name glob to a Hugging Face style, or to None (kept whole).

    A fix follows the plan it corrects, whatever release of transformers wrote it: a style replaces
    the style of a name the plan converts, and converts a name the plan leaves out only ``beside``
    a sibling the plan converts (a module acting on that sibling's split features); so a fix for a
    part the plan no longer splits does nothing."""

    entries: Mapping[str, Optional[str]]
    why: str
    applies: Callable[[object], bool] = field(default=lambda config: True)
    beside: Optional[str] = None  # a sibling module that must be converted for a name the plan leaves out


_PACKED_EXPERTS = PlanFix(
    {"*.experts.gate_up_proj": "packed_colwise"},
    "the experts' gate_up_proj holds [gate; up]: the plan's plain column split would give a rank gates without "
    "their ups; each half is split on its own instead")
_XIELU = PlanFix(
    {"*.mlp.act_fn": "replicated_with_grad_allreduce"},
    "the xIELU activation's learned alpha_p/alpha_n act on the MLP's hidden features, which TP splits, so their "
    "gradients are partial sums; the plan leaves them unsummed", beside="up_proj")

# By ``config.model_type`` (of the model or of its text config).
PLAN_FIXES: dict[str, list[PlanFix]] = {
    "apertus": [_XIELU],
    "apertus1p5_text": [_XIELU],
    "inkling_text": [_PACKED_EXPERTS],  # transformers <= 5.24 (5.25's plan leaves the experts to its EP plan)
    "inkling2_text": [_PACKED_EXPERTS],
    "inkling2_loop_text": [_PACKED_EXPERTS],
    "doge": [PlanFix(
        {"*.self_attn.*": None},
        "DogeAttention builds its dynamic mask from every key/value head (dt_proj mixes them all, A holds one "
        "value per head) while q, k and v would hold this rank's heads only, so its attention stays whole")],
    "gemma3n_text": [PlanFix(
        {"*.mlp.*": None},
        "activation sparsity (activation_sparsity_pattern) takes a mean and standard deviation over the MLP's "
        "hidden features, which TP splits, so the MLPs stay whole",
        applies=lambda c: any(getattr(c, "activation_sparsity_pattern", None) or ()))],
    "gemma4": [PlanFix(
        {"*embed_tokens": None, "lm_head": None},
        "Gemma4ForConditionalGeneration reads embed_tokens.weight[pad_token_id] outside the embedding's forward, "
        "which a vocabulary split would answer with another row, so the embedding (and the head tied to it) "
        "stay whole")],
}


def plan_fixes(model) -> list[PlanFix]:
    """The fixes that apply to ``model`` (by its config's and its text config's ``model_type``)."""
    configs = [getattr(model, "config", None), text_config(model)]
    types = {getattr(c, "model_type", None) for c in configs if c is not None}
    return [fix for t in types for fix in PLAN_FIXES.get(t, ()) if fix.applies(text_config(model))]


def apply_fixes(model, resolved: dict[str, tuple], names: list[str]) -> tuple[dict[str, tuple], dict[str, str]]:
    """``(plan, {name: why it stays whole})``: ``resolved`` (``{module or parameter name: (style,
    options)}``) with `plan_fixes` applied (see `PlanFix`); ``names`` are the model's module and
    parameter names."""
    plan, dense = dict(resolved), {}
    for fix in plan_fixes(model):
        for glob, hf_style in fix.entries.items():
            for name in [n for n in names if fnmatch.fnmatchcase(n, glob)]:
                if hf_style is None:
                    if plan.pop(name, None) is not None:
                        dense[name] = fix.why
                elif name in plan or (fix.beside and f"{name.rpartition('.')[0]}.{fix.beside}" in resolved):
                    plan[name] = translate_hf_plan({glob: hf_style}, model)[glob]
    return plan, dense


def _groups(names) -> str:
    """Names as their distinct layer patterns, for a message."""
    return ", ".join(sorted({layer_pattern(n) for n in names}))


def per_head_norms(model, resolved: dict[str, tuple]) -> tuple[dict[str, tuple], list[str]]:
    """``({name: ("partial_grad", {})}, notes)`` for the per-head norms a plan leaves out.

    A module inside an attention whose projections the plan splits by column (whole heads per
    rank), whose own parameters are all vectors of one head's width (a q/k norm applied to each
    head), sees this rank's heads only: its parameters' gradients are partial sums over TP, which
    `replicated_with_grad_allreduce` sums. Qwen3's plan says so; GLM-4-MoE's with ``use_qk_norm``
    (Param2-MoE, Sarvam-MoE) does not."""
    split_attention = {_attention_owner(model, n) for n, (style, options) in resolved.items()
                       if style == "column" and not options.get("gather_output")} - {None}
    added = {}
    for name, module in model.named_modules():
        owner = _attention_owner(model, name)
        if owner not in split_attention or owner == name or name in resolved:
            continue
        own = [p for _, p in module.named_parameters(recurse=False)]
        if own and all(p.dim() == 1 and p.numel() == _head_width(model, owner) for p in own) and not any(
                True for child in module.children() for _ in child.parameters()):
            added[name] = ("partial_grad", {})
    if not added:
        return {}, []
    return added, [f"{_groups(added)}: per-head norms the plan leaves out, applied to this rank's heads only: their "
                   f"gradients are summed over TP (replicated_with_grad_allreduce)"]


def _head_width(model, attention: str) -> Optional[int]:
    """The width of one head of the attention module ``attention`` (its ``head_dim``: a config
    with per-layer geometries has no single one), or None."""
    width = getattr(model.get_submodule(attention), "head_dim", None)
    return width if isinstance(width, int) else None


def expert_entries(model, resolved: dict[str, tuple], from_ep_plan: dict[str, tuple],
                   tp: int) -> tuple[dict[str, tuple], dict[str, str], list[str]]:
    """``(entries, {name: why it stays whole}, notes)``: the experts the tensor-parallel plan
    ``resolved`` leaves whole that the model's expert-parallel plan splits (``from_ep_plan``: its
    `EXPERT_STYLES` entries, resolved), split by it over the TP group (style ``experts``: whole
    experts per rank). Experts the tensor-parallel plan names (a module, a parameter of it, a
    module around it) follow that plan."""
    def named_by_tp(name):
        return any(n == name or n.startswith(name + ".") or name.startswith(n + ".") for n in resolved)

    entries, dense = {}, {}
    for name, (style, _) in from_ep_plan.items():
        if style != "experts" or named_by_tp(name):
            continue
        experts = getattr(model.get_submodule(name), "num_experts", None)
        if isinstance(experts, int) and experts < tp:
            dense[name] = f"its {experts} experts cannot give each of tp={tp} ranks one"
            continue
        entries.update({n: v for n, v in from_ep_plan.items() if n == name or n.startswith(name + ".")})
    if not entries:
        return {}, dense, []
    modules = [n for n, (style, _) in entries.items() if style == "experts"]
    return entries, dense, [
        f"{_groups(modules)}: experts the tensor-parallel plan leaves whole, split by the model's expert-parallel plan "
        f"(base_model_ep_plan) over the TP group: whole experts per rank, each rank running its own on the tokens "
        f"routed to them, the outputs summed (transformers' all_reduce expert parallelism). transformers 5.25 moved "
        f"most models' experts from the tensor-parallel plan, which split each expert's features, to that plan "
        f"(transformers {transformers_version()} installed)"]


def unnamed_layers_hint(model_name: str, unnamed: list[str], fraction: float) -> str:
    """What to do when a model's own plan leaves most of it whole (LFM2's names only its embedding
    and head): a plan of one's own, naming ``unnamed`` (dense layer patterns) too."""
    shown = ", ".join(unnamed[:6]) + (", ..." if len(unnamed) > 6 else "")
    return (f"{model_name}'s own plan splits {fraction:.0%} of its parameters; {len(unnamed)} dense layer patterns "
            f"stay whole because it does not name them ({shown}). "
            f"To split them, pass a plan of your own: plan={{**model.tp_plan, <pattern>: <style>, ...}} naming them "
            f"(docs/converting-models.md, 'A plan of your own for a Hugging Face model', has one for LFM2), and "
            f"check it with bigdense.testing.check_parallel")


def _attention_owner(model, name: str) -> Optional[str]:
    """The attention module ``name`` (a module or a parameter) belongs to, if any: the nearest
    enclosing module whose class or attribute name says attention."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        path = ".".join(parts[:i])
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # a parameter's name
        if re.search(r"attention|attn", type(module).__name__, re.I) or re.search(r"attention|attn", parts[i - 1], re.I):
            return path
    return None


def undividable_heads(model, resolved: dict[str, tuple], tp: int) -> dict[str, str]:
    """``{name: why it stays whole}`` for the plan entries inside attention modules when the
    model's attention heads (or key/value heads) do not divide over ``tp`` ranks: each rank must
    hold whole heads, and grouped-query attention the same share of both."""
    counts = _head_counts(text_config(model))
    bad = [(h, kv) for h, kv in counts if h % tp or kv % tp]
    if tp == 1 or not bad:
        return {}
    heads, kv = bad[0]
    why = (f"{heads} attention heads ({kv} key/value heads) do not divide over tp={tp}: each rank must hold whole "
           f"heads, so the attention stays whole")
    return {name: why for name in resolved if _attention_owner(model, name) is not None}


def _head_counts(config) -> list[tuple[int, int]]:
    """``(attention heads, key/value heads)`` of every kind of layer the config describes (a config
    with per-layer overrides has several)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None) or (lambda k, d: getattr(config, k, d))
    heads = read("num_attention_heads", None)
    if not isinstance(heads, int):
        return []
    counts = [(heads, read("num_key_value_heads", None) or heads)]
    spec = getattr(config, "__dict__", {}).get("_heterogeneity_spec")
    for override in (getattr(spec, "per_layer_overrides", None) or {}).values():
        h = override.get("num_attention_heads", heads)
        counts.append((h, override.get("num_key_value_heads", counts[0][1] if h == heads else h)))
    return counts


def dropout_notes(model, resolved: dict[str, tuple]) -> list[str]:
    """What a converted model's own dropout does differently: attention dropout acts on this rank's
    heads, drawn from the global random stream, which every TP rank holds alike (it must, for the
    dropout on replicated activations to agree), so a head on one rank gets the mask of its
    counterpart on every other rank."""
    config = text_config(model)
    if not any(_attention_owner(model, name) for name in resolved):
        return []
    rates = {k: v for k, v in vars(config).items()
             if re.search(r"attention.*dropout|attn_pdrop|attention_probs_dropout", k) and isinstance(v, float) and v > 0}
    return [f"{key}={rate} drops attention probabilities of this rank's heads with the random numbers every TP rank "
            f"draws alike: heads on different ranks get the same masks (set it to 0, as fine-tuning usually does, "
            f"for dropout that does not depend on the layout)" for key, rate in rates.items()]


def unaligned_experts_to_eager(model) -> list[str]:
    """Experts whose split weights' rows are not a multiple of 16 bytes run transformers' eager loop.

    transformers runs grouped experts (``gate_up_proj (E, 2I, H)``) through ``torch._grouped_mm``,
    whose kernels need every row of its operands to be a multiple of 16 bytes; an uneven split (an
    intermediate size of 64 over 3 ranks: 22, 21, 21 rows of fp32) breaks that. Those experts get
    a config of their own asking for the eager implementation (the same arithmetic, a loop over
    experts), on every rank alike; the others are left as they are. Returns a note per module so
    changed."""
    from ..layers.base import TensorParallelModule

    notes = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not isinstance(module, TensorParallelModule) or getattr(config, "_experts_implementation", "eager") in (
                "eager", None):
            continue
        for pname, spec in module.bd_shard_specs().items():
            # Every rank's split width (the activations between the experts' two projections have it
            # too) and rows; decided from all ranks' sizes, so every rank runs the same kernels. A
            # split of the experts themselves (dim 0) leaves every row and activation whole.
            widths = ({n * spec.parts for n in spec.sizes} if spec.dim > 0 else set()) | {spec.local_shape[-1]}
            bad = [w for w in sorted(widths) if (w * getattr(module, pname).element_size()) % 16]
            if bad:
                module.config = copy.copy(config)
                module.config._experts_implementation = "eager"
                notes.append(f"{name}: its split {pname} has rows of {bad[0]} elements on some rank, not a multiple "
                             f"of 16 bytes as torch._grouped_mm needs, so these experts run transformers' eager loop")
                break
    return notes


def is_hf_model(model) -> bool:
    """A transformers model: its config is where a tensor-parallel plan would be."""
    return hasattr(getattr(model, "config", None), "base_model_tp_plan")


def no_plan_error(model, dense_names) -> ValueError:
    """For a transformers model that carries no plan: the automatic patterns would miss its layers
    (its MLPs are not ``nn.Sequential``) and convert only what gains nothing, so say what to do."""
    generic = sorted({layer_pattern(n) for n in dense_names})
    return ValueError(
        f"parallelize: {type(model).__name__} carries no Hugging Face tensor-parallel plan (config.base_model_tp_plan "
        f"is empty); set config.base_model_tp_plan before building it, or pass plan=. Its linear layers: {generic[:12]}"
    )
