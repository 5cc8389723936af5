"""The tensor-parallel plans Hugging Face ``transformers`` models carry, as `parallelize` plans.

A transformers model declares how to shard it: ``config.base_model_tp_plan`` for the base model
(Llama: ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``) and
the model class's ``_tp_plan`` for what wraps it (``{"lm_head": "colwise_gather_output"}``);
transformers merges both into the instance's ``_tp_plan`` under full module names. The styles that
mean what a bigdense layer does are translated; any other style is refused with the modules that
use it, so a plan is never applied in part. transformers itself is not imported here.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

# Hugging Face style -> (bigdense style, constructor options)
HF_STYLES = {
    "colwise": ("column", {}),
    "rowwise": ("row", {}),
    "colwise_gather_output": ("column", {"gather_output": True}),
    "embedding_rowwise": ("vocab", {}),  # rows of the table split over ranks, output all-reduced
}


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


def translate_hf_plan(plan: Mapping[str, str]) -> dict[str, tuple]:
    """The same plan in bigdense styles; a style bigdense does not implement is refused, naming it."""
    refused = {pattern: style for pattern, style in plan.items() if style not in HF_STYLES}
    if refused:
        raise ValueError(
            f"parallelize: the model's Hugging Face tensor-parallel plan uses styles bigdense does not implement: "
            f"{refused}; supported: {sorted(HF_STYLES)}. Pass plan= naming the modules to convert "
            f"('column', 'row', 'vocab', 'head')"
        )
    return {pattern: HF_STYLES[style] for pattern, style in plan.items()}


def is_hf_model(model) -> bool:
    """A transformers model: its config is where a tensor-parallel plan would be."""
    return hasattr(getattr(model, "config", None), "base_model_tp_plan")


def no_plan_error(model, dense_names) -> ValueError:
    """For a transformers model that carries no plan: the automatic patterns would miss its layers
    (its MLPs are not ``nn.Sequential``) and convert only what gains nothing, so say what to do."""
    generic = sorted({re.sub(r"\d+", "*", n) for n in dense_names})
    return ValueError(
        f"parallelize: {type(model).__name__} carries no Hugging Face tensor-parallel plan (config.base_model_tp_plan "
        f"is empty); set config.base_model_tp_plan before building it, or pass plan=. Its linear layers: {generic[:12]}"
    )
