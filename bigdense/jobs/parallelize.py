"""`parallelize_model`: everything a job does to a model between building it and training it, in
one fixed order, for every job (`launch/train.py`, `launch/classify.py`, `python -m
bigdense.compress`, the memory planner's measurement).

1. Tensor parallelism. bigdense's models are built sharded over the mesh's TP group from their
   config (`bigdense.jobs.models`); any other module is converted by `bd.parallelize` (its own
   Hugging Face plan, or the automatic Linear pairs); a `CausalLM`'s transformers model by its plan.
2. The starting weights, loaded into the plain model before an engine takes copies of them
   (DeepSpeed's fp32 masters): ``init_from`` (a checkpoint of any layout), else a Hugging Face
   model's own directory (`load_hf_weights`, each rank reading its shards; a model built on the
   meta device is allocated first). Then low-rank adapters (the ``lora`` group, or ``model.adapter``'s
   PEFT directory: `apply_adapters`), which freeze the base, frozen embeddings
   (``model.freeze_embeddings``), and a
   `CausalLM`'s loss path (`CausalLM.prepare_loss`: the fused head, its logit transform proved on
   a probe batch, or the gathered logits and why; logged), on the weights just loaded or, for a
   resumed run whose checkpoint comes later, on placeholder weights.
3. ``torch.compile`` of each transformer block (``trainer.compile=blocks``).
4. Activation checkpointing (the ``recompute`` group), around the compiled blocks.
5. ``torch.compile`` of the whole model's forward (``trainer.compile=model``), around the
   checkpointed blocks.
6. The engine (the ``engine`` group): data parallelism, precision, the optimizer, clipping, and
   the CUDA-graph capture of the step (``trainer.cuda_graphs``).

As torchtitan's ``parallelize_llama``: TP before compile (it changes the graphs), per-block
checkpointing after per-block compile (it wraps what was compiled), a whole-model compile after
checkpointing (it traces the recompute into its backward graph), the engine last (it wraps the
finished model).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from ..checkpoint import CheckpointMismatch, load_checkpoint
from ..checkpoint.hf_import import load_hf_weights
from ..errors import ConfigError
from ..checkpoint.peft import load_peft_adapter
from ..layers.base import TensorParallelModule, allocate_empty, global_numel
from ..layers.lora import adapted_layers, add_lora, cast_frozen_weights_, lora_settings
from ..models import CausalLM
from ..parallel.context import ParallelContext
from ..parallelize import parallelize
from ..train.checkpointing import model_changes
from ..train.compile import apply_compile
from ..train.engines import Engine, EngineSettings, build_engine
from ..train.precision import DTYPES
from ..train.recompute import apply_recompute

log = logging.getLogger("bigdense")


@dataclass
class Parallelized:
    """What `parallelize_model` made: the model (sharded, compiled, checkpointed as asked) and its
    engine (None when none was asked for)."""

    model: nn.Module
    engine: Optional[Engine]


def parallelize_model(model: nn.Module, ctx: ParallelContext, cfg, *, init_from: Optional[str] = None,
                      load_pretrained: bool = True, engine: bool = True) -> Parallelized:
    """Apply the run config ``cfg``'s parallelism to ``model`` on ``ctx``'s mesh (see the module
    docstring for the order). ``load_pretrained=False`` skips a Hugging Face model's own weights (a
    resumed run reads its checkpoint instead). ``engine=False`` stops before the engine (a job that
    only runs the model: compression); the model's blocks are ``model.blocks``."""
    if isinstance(model, CausalLM) and ctx.tp_size > 1:
        model.lm = parallelize(model.lm, tp_group=ctx.tp_group)  # by the transformers model's own plan
    elif not _is_sharded(model) and ctx.tp_size > 1:
        model = parallelize(model, tp_group=ctx.tp_group)
    if any(p.device.type == "meta" for p in model.parameters()):
        allocate_empty(model, ctx.device)
    weights_loaded = bool(init_from) or (load_pretrained and bool(getattr(model, "pretrained", None)))
    if init_from:
        meta = _load_starting_weights(init_from, model, cfg)
        log.info("model weights from %s (saved at step %s)", meta.path, meta.step)
    elif load_pretrained and getattr(model, "pretrained", None):
        unused = load_hf_weights(model, model.pretrained)
        log.info("model weights from %s%s", model.pretrained, f" ({len(unused)} stored tensors unused: "
                 f"{unused[:4]})" if unused else "")
    apply_adapters(model, cfg)
    if getattr(cfg.model, "freeze_embeddings", False):
        log.info("frozen (model.freeze_embeddings): %s", ", ".join(model.freeze_embeddings()))
    if isinstance(model, CausalLM):  # (a resumed run's checkpoint is read later: placeholder weights meanwhile)
        path = model.prepare_loss(weights_loaded=weights_loaded)
        (log.info if path.fused or not model.fused_loss else log.warning)(
            "loss of %s: %s", type(model.lm).__name__, path.describe())
    blocks = getattr(model, "blocks", None)
    if blocks is None and cfg.recompute.mode != "none":
        raise ConfigError(f"recompute.mode acts on a model's transformer blocks (its `blocks`); "
                          f"{type(model).__name__} has none")
    apply_compile(model, cfg.trainer.compile, cfg.trainer.compile_backend, stage="before_recompute")
    if blocks is not None:
        apply_recompute(blocks, cfg.recompute)
    apply_compile(model, cfg.trainer.compile, cfg.trainer.compile_backend, stage="after_recompute")
    return Parallelized(model, build_engine(model, ctx, EngineSettings.from_run_config(cfg)) if engine else None)


def adapters_wanted(cfg) -> bool:
    """The run trains low-rank adapters (``lora.r`` > 0 or ``model.adapter``): its base is frozen and
    its checkpoints do not hold it, so a resumed run loads the base as a fresh one does."""
    lora = getattr(cfg, "lora", None)
    return bool(getattr(cfg.model, "adapter", None)) or (lora is not None and int(lora.r) > 0)


def apply_adapters(model: nn.Module, cfg) -> None:
    """Give ``model`` the run's adapters, the base frozen (`bigdense.layers.lora`): ``model.adapter``'s
    PEFT directory (its settings and weights, to continue training it), else the ``lora`` group's
    fresh ones; the frozen base's dense weights cast to ``lora.base_dtype``. Logs what trains."""
    if not adapters_wanted(cfg):
        return
    lora = cfg.lora
    if getattr(cfg.model, "adapter", None):
        settings = load_peft_adapter(model, cfg.model.adapter)
        source = f"from {cfg.model.adapter}"
    else:
        add_lora(model, r=int(lora.r), alpha=lora.alpha, targets=_targets(lora.targets), dropout=float(lora.dropout),
                 rslora=bool(lora.rslora))
        settings, source = lora_settings(next(iter(adapted_layers(model).values()))), "new"
    if lora.base_dtype:
        cast_frozen_weights_(model, DTYPES[lora.base_dtype])
    trainable, total = global_numel(model, trainable_only=True), global_numel(model)
    log.info("adapters (%s): r=%d alpha=%g dropout=%g%s on %d layers; trainable %s of %s parameters (%.2f%%)%s",
             source, settings.r, settings.alpha, settings.dropout, ", rsLoRA" if settings.rslora else "",
             len(adapted_layers(model)), f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1),
             f"; frozen dense weights in {lora.base_dtype}" if lora.base_dtype else "")


def _targets(targets):
    """``lora.targets`` as `add_lora` takes it (a Hydra list becomes a plain one)."""
    return targets if targets is None or isinstance(targets, str) else [str(t) for t in targets]


def _load_starting_weights(init_from: str, model: nn.Module, cfg):
    """``trainer.init_from``'s model weights into ``model``; a checkpoint of another model is named
    with what differs (`model_changes`)."""
    try:
        return load_checkpoint(init_from, model, load_rng=False)
    except CheckpointMismatch as err:
        changes = model_changes(init_from, cfg)
        raise CheckpointMismatch(
            f"trainer.init_from={init_from} holds another model's weights: {changes or err}. Build the model it "
            f"was saved from (its model.* keys, recorded in its manifest.json)") from err


def _is_sharded(model: nn.Module) -> bool:
    """Built with bigdense's layers (sharded over TP from the start)."""
    return any(isinstance(m, TensorParallelModule) for m in model.modules())
