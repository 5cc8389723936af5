"""`validate`: every check a person can act on, before any work, on every rank alike.

Each rule is asked of the code that owns it (`layers.mlp.ACTIVATIONS`, `train.recompute.MODES`,
`ParallelDims`, the engines, ...); what is written here are the model's keys and the combinations
of groups. Raises `bigdense.ConfigError` naming the key.
"""
from __future__ import annotations

import os

from ..checkpoint.format import CheckpointError, resolve_checkpoint
from ..checkpoint.peft import CONFIG_FILE as PEFT_CONFIG_FILE
from ..data.prepare import check_data
from ..errors import ConfigError, check_choice, check_positive
from ..layers.head.modes import SHARD_MODES
from ..layers.init import INITIALIZERS
from ..layers.lora import ALL_LINEAR, LoRASettings
from ..layers.head.fused_ce import check_logit_options
from ..layers.head.margin import resolve_margin
from ..layers.mlp import ACTIVATIONS
from ..compression.prune_schedule import check_prune_schedule
from ..layers.head.sampling import check_sample_rate
from ..models import MODELS
from ..models.hf_dir import HFDirectory
from ..models.gpt import ATTENTION_DROPOUT_MODES, check_heads
from ..parallel.context import ParallelDims
from ..train.checkpointing import check_checkpointing
from ..train.compile import check_compile, compile_mode
from ..train.cuda_graphs import check_cuda_graphs
from ..train.engines import EngineSettings
from ..train.engines.factory import check_engine
from ..train.precision import check_precision
from ..train.recompute import check_recompute
from .keys import check_known_keys


def validate(cfg, world_size: int, device_type: str) -> ParallelDims:
    """Every check a person can act on, before any work, for ``world_size`` processes on
    ``device_type``; returns the mesh (`ParallelDims`, resolved here, once per launch).
    ``cfg`` is a TrainConfig or DictConfig. Raises `ConfigError`.
    """
    check_known_keys(cfg)
    m = cfg.model
    check_choice("model.name", m.name, MODELS)
    check_recompute(cfg.recompute.mode, cfg.recompute.every)
    check_precision(cfg.precision, device_type)
    check_engine(EngineSettings.from_run_config(cfg), device_type)  # optimizer and schedule included
    check_data(cfg.data)
    for key in ("trainer.log_interval", "trainer.eval_batches", "parallel.timeout_s"):
        group, name = key.split(".")
        check_positive(key, getattr(getattr(cfg, group), name))
    for key in ("trainer.eval_interval", "trainer.save_interval", "trainer.checked_steps"):
        group, name = key.split(".")
        check_positive(key, getattr(getattr(cfg, group), name), allow_zero=True)
    check_compile(cfg.trainer.compile_backend, cfg.trainer.compile)
    check_cuda_graphs(bool(cfg.trainer.cuda_graphs), device_type=device_type, engine=str(cfg.engine.kind),
                      world_size=world_size, compile_mode=compile_mode(cfg.trainer.compile),
                      recompute=str(cfg.recompute.mode), sampled_head=float(cfg.head.sample_rate) < 1.0,
                      pruning=float(cfg.prune.sparsity) > 0)
    if cfg.trainer.peak_tflops is not None:
        check_positive("trainer.peak_tflops", cfg.trainer.peak_tflops)
    check_checkpointing(cfg.trainer)
    _check_init_from(getattr(cfg.trainer, "init_from", None))
    check_prune_schedule(cfg.prune, cfg.engine.kind)
    dims = ParallelDims.resolve(cfg.parallel.tp, cfg.parallel.dp, world_size)
    _check_logit_options("model", m)
    if m.name == "hf":
        _validate_hf_model(cfg)
    else:
        _validate_gpt_model(cfg, dims.tp, world_size)
    _validate_head(cfg)
    _validate_lora(cfg)
    return dims


def _validate_gpt_model(cfg, tp: int, world_size: int) -> None:
    """The model keys of bigdense's own models (``model.name`` gpt or encoder)."""
    m = cfg.model
    check_choice("model.activation", m.activation, ACTIVATIONS)
    check_choice("model.init", m.init, sorted(INITIALIZERS))
    for key in ("d_model", "n_layers", "n_heads", "max_seq_len"):
        check_positive(f"model.{key}", getattr(m, key))
    for key in ("d_hidden", "head_chunk_size"):  # None: the model's own choice
        if getattr(m, key) is not None:
            check_positive(f"model.{key}", getattr(m, key))
    for key in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, key) < 1.0:
            raise ConfigError(f"model.{key} must be in [0, 1), got {getattr(m, key)}")
    check_choice("model.attention_dropout_mode", m.attention_dropout_mode, ATTENTION_DROPOUT_MODES)
    if m.vocab_size is not None and m.vocab_size < cfg.data.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={cfg.data.vocab_size}: "
                          "the tokenizer would produce ids the embedding does not have (leave it null)")
    low_rank = getattr(m, "low_rank", None)
    if low_rank is not None and not hasattr(low_rank, "items"):
        raise ConfigError(f"model.low_rank must be a mapping {{module path: rank}} or null, got {low_rank!r}")
    for path, rank in (low_rank or {}).items():
        check_positive(f"model.low_rank[{path}]", rank)
    if not getattr(m, "fused_loss", True):
        raise ConfigError("model.fused_loss=false keeps a model=hf model's own logits path; bigdense's GPT always "
                          "computes its loss through the fused head")
    if getattr(m, "freeze_embeddings", False):
        raise ConfigError(f"model.freeze_embeddings applies to model=hf (a fine-tuned Hugging Face model), not "
                          f"model.name={m.name!r}")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    check_heads(m.d_model, m.n_heads, tp, key="model.", tp_key="parallel.tp", world_size=world_size)


def _validate_hf_model(cfg) -> None:
    """``model=hf``: a save_pretrained directory whose positions cover ``data.seq_len`` and whose
    vocabulary holds the tokenizer's ids (its own, or a BPE trained with ``data.vocab_size``)."""
    from omegaconf.errors import MissingMandatoryValue  # here: bench.gpu imports this module without omegaconf

    try:
        path = cfg.model.path
    except MissingMandatoryValue:  # conf/model/hf.yaml's ???: Hydra's own message names no fix
        path = None
    source = HFDirectory.open(path)
    if source.max_positions is not None and cfg.data.seq_len > source.max_positions:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
                          f"{source.max_positions} ({source.path / 'config.json'})")
    if source.tokenizer() is None and cfg.data.vocab_size > source.vocab_size:
        raise ConfigError(f"model.path={cfg.model.path!r} has no tokenizer.json, so a BPE is trained on the corpus with "
                          f"data.vocab_size={cfg.data.vocab_size} entries, more than the model's vocab_size="
                          f"{source.vocab_size}: set data.vocab_size<={source.vocab_size}")
    if cfg.model.low_rank:
        raise ConfigError("model.low_rank builds bigdense's GPT with low-rank layers; it does not apply to model=hf")
    if cfg.model.softcap:
        raise ConfigError(f"model.softcap={cfg.model.softcap} caps bigdense's GPT's logits; a model=hf model keeps its own "
                          f"logit transform (its config's final_logit_softcapping, found when it is converted): leave "
                          f"model.softcap null")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel=true splits bigdense's GPT along the sequence; model=hf is "
                          "converted by its own Hugging Face plan, whose sequence_parallel entries decide that")


def _check_init_from(init_from) -> None:
    """``trainer.init_from`` names a complete checkpoint (a run directory or its checkpoints/ will do)."""
    if not init_from:
        return
    if not os.path.exists(os.path.expanduser(str(init_from))):
        raise ConfigError(f"trainer.init_from={init_from!r} does not exist")
    try:
        resolve_checkpoint(os.path.expanduser(str(init_from)))
    except CheckpointError as err:
        raise ConfigError(f"trainer.init_from={init_from!r}: {err}") from None


def _check_logit_options(group: str, options) -> None:
    """``<group>.softcap`` and ``<group>.z_loss`` by the fused loss's rule (`check_logit_options`)."""
    try:
        check_logit_options(f"{group}.", getattr(options, "softcap", None), getattr(options, "z_loss", None))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _validate_head(cfg) -> None:
    """The head's own rules (from `bigdense.layers`), reported under their config keys."""

    head = cfg.head
    _check_logit_options("head", head)
    check_choice("head.shard", head.shard, SHARD_MODES)
    margin = head.margin if head.margin is None or isinstance(head.margin, str) else tuple(head.margin)
    for key, check in (("head.sample_rate", lambda: check_sample_rate(head.sample_rate, "head")),
                       ("head.margin", lambda: resolve_margin(margin, head.scale, "head"))):
        try:
            check()
        except ValueError as err:
            raise ConfigError(f"{key}={getattr(head, key.split('.')[1])!r}: {err}") from None


def _validate_lora(cfg) -> None:
    """The ``lora`` group by the adapters' own rules (`LoRASettings`), ``model.adapter``'s directory,
    and the combinations: a frozen base in the autocast dtype only, no pruning of frozen weights."""
    lora, adapter = getattr(cfg, "lora", None), getattr(cfg.model, "adapter", None)
    if lora is None:
        return
    if not isinstance(lora.r, int) or lora.r < 0:
        raise ConfigError(f"lora.r must be 0 (no adapters) or a positive rank, got {lora.r!r}")
    if adapter and not os.path.isfile(os.path.join(os.path.expanduser(str(adapter)), PEFT_CONFIG_FILE)):
        raise ConfigError(f"model.adapter={adapter!r} is not a PEFT adapter directory (no {PEFT_CONFIG_FILE})")
    if lora.r == 0 and not adapter:
        return
    if lora.r:
        try:
            LoRASettings(lora.r, float(lora.r if lora.alpha is None else lora.alpha), float(lora.dropout),
                         bool(lora.rslora))
        except ValueError as err:
            raise ConfigError(str(err).replace("add_lora: ", "lora.")) from None
        targets = lora.targets
        if not (isinstance(targets, str) or (targets is not None and all(isinstance(t, str) for t in targets))):
            raise ConfigError(f"lora.targets must be '{ALL_LINEAR}' or a list of module name patterns, got {targets!r}")
    if lora.base_dtype is not None and lora.base_dtype != cfg.precision.dtype or lora.base_dtype == "fp32":
        raise ConfigError(f"lora.base_dtype={lora.base_dtype!r} holds the frozen weights in the compute dtype of "
                          f"precision={cfg.precision.dtype} (autocast): set it to null, or use precision="
                          f"{lora.base_dtype}")
    if float(cfg.prune.sparsity) > 0:
        raise ConfigError("prune.sparsity > 0 prunes the weights that train; with adapters (lora.r > 0 or "
                          "model.adapter) they are frozen: prune a full fine-tune, or leave prune.sparsity=0")


def validate_plan(plan) -> None:
    """The ``plan.*`` keys; errors name the key."""
    check_choice("plan.device_type", plan.device_type, ("cuda", "cpu"))
    for key in ("device_gb", "tflops", "tflops_fp32", "tp_gbps", "dp_gbps", "latency_us", "top"):
        check_positive(f"plan.{key}", getattr(plan, key))
    if plan.devices is not None:
        check_positive("plan.devices", plan.devices)
    if plan.overhead_gb is not None:
        check_positive("plan.overhead_gb", plan.overhead_gb, allow_zero=True)
