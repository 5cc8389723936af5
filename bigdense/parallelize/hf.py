"""The tensor-parallel plans Hugging Face ``transformers`` models carry, as `parallelize` plans.

A transformers model declares how to shard it: ``config.base_model_tp_plan`` for the base model
(Llama: ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``),
the model class's ``_tp_plan`` for what wraps it (``{"lm_head": "colwise_gather_output"}``), and an
``embed_tokens: embedding_rowwise`` transformers adds; it merges them into the instance's
``_tp_plan`` under full module names. Patterns match module *and* parameter names, a ``*`` standing
for a layer number (``layers.*.mlp.experts.gate_up_proj`` names a parameter: only split it).

Every style transformers defines (``transformers/distributed/tensor_parallel.py``) has its meaning
here as a bigdense style (`HF_STYLES`; what each does is `bigdense.parallelize.styles`). Where a
model's own plan would train wrong, bigdense corrects it or keeps the affected modules whole, and
says why (`PLAN_FIXES`); attention whose heads do not divide over the TP group stays whole
(`undividable_heads`). transformers itself is not imported here.
"""
from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

# Hugging Face style -> (bigdense style, options)
HF_STYLES = {
    "colwise": ("column", {}),
    "colwise_gather_output": ("column", {"gather_output": True}),
    "colwise_rep": ("column", {"gather_output": True}),
    "rowwise": ("row", {}),
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
    "moe_identity_expert": ("divide_input", {}),
    "mla_kv_a_proj": ("mla_kv_a", {}),  # rope_dim: the config's qk_rope_head_dim (`translate_hf_plan`)
    "local_params": ("local", {}),
    "replicate": ("replicate", {}),
}


def layer_pattern(name: str) -> str:
    """``model.layers.3.mlp.w1`` -> ``model.layers.*.mlp.w1``: the layer numbers (dotted numeric
    segments) become ``*``, as transformers matches plans; digits inside a name stay."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def hf_tp_plan(model) -> Optional[dict[str, str]]:
    """``{module pattern: Hugging Face style}`` that ``model`` carries, or None if it carries none."""
    merged = getattr(model, "_tp_plan", None)
    if isinstance(merged, Mapping) and merged:
        return dict(merged)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        wrapped = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
        plan.update({(f"{prefix}." if wrapped else "") + pattern: style for pattern, style in base.items()})
    return plan or None


def text_config(model):
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def translate_hf_plan(plan: Mapping[str, str], model=None) -> dict[str, tuple]:
    """The same plan in bigdense styles; a style transformers does not define is refused, naming it."""
    refused = {pattern: style for pattern, style in plan.items() if style not in HF_STYLES}
    if refused:
        raise ValueError(
            f"parallelize: the model's Hugging Face tensor-parallel plan uses styles bigdense does not know: "
            f"{refused}; known: {sorted(HF_STYLES)}. Pass plan= naming the modules to convert"
        )
    out = {}
    for pattern, hf_style in plan.items():
        style, options = HF_STYLES[hf_style]
        if style == "mla_kv_a":
            options = {"rope_dim": int(getattr(text_config(model), "qk_rope_head_dim", 0) or 0)}
        out[pattern] = (style, dict(options))
    return out


@dataclass(frozen=True)
class PlanFix:
    """A model's own plan that would train wrong, and what bigdense does instead: ``entries`` maps
    a module-name glob to a Hugging Face style (converted so), or to None (kept whole)."""

    entries: Mapping[str, Optional[str]]
    why: str
    applies: Callable[[object], bool] = field(default=lambda config: True)


_PACKED_EXPERTS = PlanFix(
    {"*.experts.gate_up_proj": "packed_colwise"},
    "the experts' gate_up_proj holds [gate; up]: the plan's plain column split would give a rank gates without "
    "their ups; each half is split on its own instead")
_XIELU = PlanFix(
    {"*.mlp.act_fn": "replicated_with_grad_allreduce"},
    "the xIELU activation's learned alpha_p/alpha_n act on the MLP's hidden features, which TP splits, so their "
    "gradients are partial sums; the plan leaves them unsummed")

# By ``config.model_type`` (of the model or of its text config).
PLAN_FIXES: dict[str, list[PlanFix]] = {
    "apertus": [_XIELU],
    "apertus1p5_text": [_XIELU],
    "sarvam_moe": [PlanFix(
        {"*.self_attn.q_norm": "replicated_with_grad_allreduce", "*.self_attn.k_norm": "replicated_with_grad_allreduce"},
        "its per-head q/k norms (use_qk_norm) see this rank's heads only, so their gradients are partial sums; the "
        "plan (copied from glm4_moe) leaves them out", applies=lambda c: bool(getattr(c, "use_qk_norm", False)))],
    "inkling_text": [_PACKED_EXPERTS],
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
    options)}``) with `plan_fixes` applied; ``names`` are the model's module and parameter names."""
    plan, dense = dict(resolved), {}
    for fix in plan_fixes(model):
        for glob, hf_style in fix.entries.items():
            for name in [n for n in names if fnmatch.fnmatchcase(n, glob)]:
                if hf_style is None:
                    if plan.pop(name, None) is not None:
                        dense[name] = fix.why
                else:
                    plan[name] = translate_hf_plan({glob: hf_style}, model)[glob]
    return plan, dense


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
            # too) and rows; decided from all ranks' sizes, so every rank runs the same kernels.
            widths = {n * spec.parts for n in spec.sizes} | {spec.local_shape[-1]}
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
