"""The training configuration: one dataclass per Hydra config group, with documented defaults.

``conf/<group>/<option>.yaml`` files fill these schemas: ``conf/config.yaml`` starts from
`TrainConfig` (registered as ``_train_schema``), whose fields are the groups' dataclasses, so a
misspelt key or a wrong type fails when Hydra composes the config, naming the key. `validate` then checks what a schema cannot (ranges, combinations, the
machine) and raises `ConfigError` naming the key, before any work starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .layers.init import INITIALIZERS


class ConfigError(ValueError):
    """A configuration value a person has to change; the message names the key."""


@dataclass
class ModelConfig:
    """The network. ``vocab_size`` defaults to the tokenizer's."""

    name: str = "gpt"  # the decoder LM of bigdense.models (the classifier there is library-only)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4  # tensor parallelism splits heads: parallel.tp must divide this
    d_hidden: Optional[int] = None  # MLP width; None means 4 * d_model
    activation: str = "gelu"  # "gelu", "relu" or "swiglu"
    max_seq_len: int = 256
    dropout: float = 0.1
    bias: bool = True
    tie_embeddings: bool = True  # share the embedding table with the output head, shard for shard
    vocab_size: Optional[int] = None
    head_chunk_size: int = 1024  # tokens per chunk of the fused vocab-parallel cross-entropy
    init: str = "trunc_normal"  # a name from bigdense.INITIALIZERS
    # {module path: rank} or null: build these dense layers as low-rank pairs (as written by
    # `python -m bigdense.compress`; override syntax: 'model.low_rank={blocks.0.mlp.up:48}')
    low_rank: Any = None


@dataclass
class RecomputeConfig:
    """Activation checkpointing: trade a second forward for the memory of stored activations."""

    mode: str = "none"  # "none", "full" (every block), "mlp" (only the MLPs), "every_k" (every k-th block)
    every: int = 2  # k, for mode=every_k


@dataclass
class ParallelConfig:
    """The process mesh: ``tp * dp`` must equal the number of processes."""

    tp: Optional[int] = None  # None: every process in one TP group (2 under the default torchrun, 1 alone)
    dp: Optional[int] = None  # None: world_size // tp
    backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # bound on every collective, so a dead rank cannot hang the others


@dataclass
class PrecisionConfig:
    """Compute dtype. Parameters, gradients and optimizer state stay fp32 (the master weights)."""

    dtype: str = "fp32"  # "fp32", "bf16" or "fp16"
    init_scale: float = 65536.0  # fp16 only: dynamic loss scaling
    growth_interval: int = 1000  # fp16: steps without overflow before the scale doubles
    min_scale: float = 1.0


@dataclass
class EngineConfig:
    """Who runs data parallelism and the optimizer step."""

    kind: str = "ddp"  # "ddp" (torch DistributedDataParallel) or "deepspeed"
    zero_stage: int = 1  # deepspeed only: 0, 1 or 2
    bucket_cap_mb: float = 25.0  # ddp only


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and a cosine (or constant) schedule."""

    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "constant"
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclass
class DataConfig:
    """Text for the language model. ``source=stdlib`` reads this Python's own standard library."""

    source: str = "stdlib"  # "stdlib" or "files"
    path: Optional[str] = None  # source=files: a directory (or file) of UTF-8 text
    pattern: str = "**/*.py"  # files under the source directory that are read
    max_corpus_mb: float = 24.0  # read at most this much text (sorted file order)
    vocab_size: int = 32768  # byte-level BPE trained locally, cached
    seq_len: int = 128
    micro_batch_size: int = 8  # sequences per data-parallel rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    val_fraction: float = 0.02  # share of files held out for evaluation
    cache_dir: Optional[str] = None  # None: $BIGDENSE_CACHE or ~/.cache/bigdense


@dataclass
class TrainerConfig:
    """The loop: how long, how often to log, evaluate and save."""

    max_steps: int = 200
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50  # 0: evaluate only at the end
    eval_batches: int = 20
    save_interval: int = 100  # 0: save only at the end
    resume: bool = True  # continue from checkpoints/latest in the run directory if it exists
    log_rms: bool = False  # also log the RMS of every dense layer's weights, activations, gradients
    progress_bar: bool = True
    plot: bool = True  # write loss_curve.png at the end
    init_from: Optional[str] = None  # a checkpoint whose model weights start the run (any TP size; not resumed)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class PlanConfig:
    """The devices `python -m bigdense.plan` plans for (``plan.*`` keys; not part of training)."""

    device_gb: float = 80.0  # memory of one device, GiB
    devices: Optional[int] = None  # None: parallel.tp x parallel.dp (tp alone when dp is null)
    device_type: str = "cuda"  # "cuda" or "cpu": which optimizer kernels and autocast rules apply
    overhead_gb: Optional[float] = None  # CUDA context, NCCL, allocator slack; None: 1.0 on cuda, 0 on cpu
    tflops: float = 400.0  # achieved bf16/fp16 matmul TFLOP/s per device, for ranking layouts
    tflops_fp32: float = 50.0  # the same in fp32
    tp_gbps: float = 200.0  # achieved all-reduce bus bandwidth inside a TP group, GB/s
    dp_gbps: float = 25.0  # the same across the DP group
    latency_us: float = 10.0  # cost of one step of a ring collective, microseconds
    top: int = 10  # layouts printed by --suggest


def validate_plan(plan) -> None:
    """The ``plan.*`` keys; errors name the key."""
    _choice("plan.device_type", plan.device_type, ("cuda", "cpu"))
    for key in ("device_gb", "tflops", "tflops_fp32", "tp_gbps", "dp_gbps", "latency_us", "top"):
        _positive(f"plan.{key}", getattr(plan, key))
    if plan.devices is not None:
        _positive("plan.devices", plan.devices)
    if plan.overhead_gb is not None:
        _positive("plan.overhead_gb", plan.overhead_gb, allow_zero=True)


def run_dir_name() -> str:
    """The run directory's name, the same on every rank of one launch and across its restarts.

    Under torchrun it is the whole rendezvous id, and nothing else (``--standalone`` makes a fresh
    one per launch; restarts, requeues and relaunches with the same ``--rdzv-id`` keep it, even past
    midnight, so the job finds its own checkpoints); alone, the date and time.
    """
    import re
    import time

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return "torchrun-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return time.strftime("%Y-%m-%d/%H-%M-%S")


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (``conf/config.yaml`` extends ``_train_schema``)
    and the ``bd_run_dir`` resolver the run directory uses."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("bd_run_dir"):
        OmegaConf.register_new_resolver("bd_run_dir", run_dir_name, use_cache=True)
    ConfigStore.instance().store(name="_train_schema", node=TrainConfig)


def _choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def validate(cfg, world_size: int, device_type: str) -> None:
    """Every check a person can act on, before any work. ``cfg`` is a TrainConfig or DictConfig."""
    m, p, par = cfg.model, cfg.precision, cfg.parallel
    _choice("model.name", m.name, ("gpt",))
    _choice("model.activation", m.activation, ("gelu", "relu", "swiglu"))
    _choice("recompute.mode", cfg.recompute.mode, ("none", "full", "mlp", "every_k"))
    _choice("precision.dtype", p.dtype, ("fp32", "bf16", "fp16"))
    _choice("engine.kind", cfg.engine.kind, ("ddp", "deepspeed"))
    _choice("engine.zero_stage", cfg.engine.zero_stage, (0, 1, 2))
    _choice("optim.name", cfg.optim.name, ("adamw",))
    _choice("optim.schedule", cfg.optim.schedule, ("cosine", "constant"))
    _choice("data.source", cfg.data.source, ("stdlib", "files"))
    for key in ("model.d_model", "model.n_layers", "model.n_heads", "model.max_seq_len", "model.head_chunk_size",
                "data.seq_len", "data.micro_batch_size", "data.grad_accum", "trainer.max_steps",
                "trainer.log_interval", "trainer.eval_batches", "optim.lr", "recompute.every"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name))
    for key in ("optim.min_lr", "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip",
                "trainer.eval_interval", "trainer.save_interval"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name), allow_zero=True)
    for key in ("optim.eps", "precision.init_scale", "precision.growth_interval", "precision.min_scale",
                "parallel.timeout_s"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name))
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.d_hidden is not None:
        _positive("model.d_hidden", m.d_hidden)
    _choice("model.init", m.init, sorted(INITIALIZERS))
    if m.vocab_size is not None and m.vocab_size < cfg.data.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={cfg.data.vocab_size}: "
                          "the tokenizer would produce ids the embedding does not have (leave it null)")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}")
    low_rank = getattr(m, "low_rank", None)
    if low_rank is not None and not hasattr(low_rank, "items"):
        raise ConfigError(f"model.low_rank must be a mapping {{module path: rank}} or null, got {low_rank!r}")
    for path, rank in (low_rank or {}).items():
        _positive(f"model.low_rank[{path}]", rank)
    init_from = getattr(cfg.trainer, "init_from", None)
    if init_from and not os.path.exists(os.path.expanduser(str(init_from))):
        raise ConfigError(f"trainer.init_from={init_from!r} does not exist")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")

    tp = par.tp if par.tp is not None else world_size
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"parallel.tp must be a positive integer or null, got {tp!r}")
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"parallel.tp={tp} does not divide the number of processes ({world_size}); choose one of {divisors}"
        )
    dp = par.dp if par.dp is not None else world_size // tp
    if tp * dp != world_size:
        raise ConfigError(f"parallel.tp={tp} x parallel.dp={dp} = {tp * dp}, but {world_size} processes were launched")
    if m.n_heads % tp:
        ok = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]
        raise ConfigError(f"parallel.tp={tp} must divide model.n_heads={m.n_heads} (heads are split over TP); "
                          f"choose tp from {ok}")

    if p.dtype == "bf16" and device_type == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ConfigError("precision=bf16: this GPU has no bf16 support; use precision=fp16")
    if p.dtype == "fp16" and cfg.engine.kind == "deepspeed" and device_type == "cpu":
        raise ConfigError("precision=fp16 with engine=deepspeed needs a GPU: DeepSpeed's CPU accelerator has no "
                          "fp16 support; use precision=bf16, or engine=ddp")
    if cfg.data.source == "files":
        path = cfg.data.path
        if not path:
            raise ConfigError("data.source=files needs data.path (a directory or file of text)")
        if not os.path.exists(os.path.expanduser(str(path))):
            raise ConfigError(f"data.path={path!r} does not exist")
