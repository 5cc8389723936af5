"""The training configuration: one dataclass per Hydra config group, with documented defaults.

``conf/<group>/<option>.yaml`` files fill these schemas: ``conf/config.yaml`` starts from
`TrainConfig` (registered as ``_train_schema``), whose fields are the groups' dataclasses, so a
wrong type fails when Hydra composes the config, naming the key. A key no dataclass defines --
misspelt on the command line, appended with ``+`` or written in an option file -- stops the run
naming the closest valid key (`bigdense.config_keys`). `validate`
then checks what a schema cannot (ranges, combinations, the machine) and raises `ConfigError`
naming the key, before any work starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .config_keys import check_known_keys, check_override_keys, schema_keys, unknown_key_error  # noqa: F401
from .data.prepare import check_data
from .layers.init import INITIALIZERS
from .layers.mlp import ACTIVATIONS
from .models import MODELS, GPTConfig
from .models.gpt import ATTENTION_DROPOUT_MODES, check_heads
from .parallel.context import ParallelDims
from .train.checkpointing import check_checkpointing
from .train.compile import check_compile
from .train.engines import EngineSettings
from .train.engines.factory import check_engine
from .train.precision import check_precision
from .train.recompute import check_recompute
from .validation import ConfigError, check_choice, check_positive


@dataclass
class ModelConfig:
    """The network. Defaults are `bigdense.models.GPTConfig`'s; ``vocab_size`` defaults to the tokenizer's."""

    name: str = "gpt"  # one of bigdense.models.MODELS: "gpt" (launch/train.py), "encoder" (launch/classify.py)
    d_model: int = GPTConfig.d_model
    n_layers: int = GPTConfig.n_layers
    n_heads: int = GPTConfig.n_heads  # tensor parallelism splits heads: parallel.tp must divide this
    d_hidden: Optional[int] = GPTConfig.d_hidden  # MLP width; None means 4 * d_model
    activation: str = GPTConfig.activation  # one of bigdense.layers.mlp.ACTIVATIONS: "gelu", "relu", "swiglu"
    max_seq_len: int = GPTConfig.max_seq_len
    dropout: float = GPTConfig.dropout  # embeddings, attention output and MLP output (layout-free masks)
    # On the attention probabilities; 0 keeps the fused attention (SDPA) kernels.
    attention_dropout: float = GPTConfig.attention_dropout
    # When > 0: "invariant" (exact, layout-free masks; the probabilities are materialised) or
    # "fused" (SDPA's own dropout: fast, masks depend on the TP/DP layout).
    attention_dropout_mode: str = GPTConfig.attention_dropout_mode
    bias: bool = GPTConfig.bias
    tie_embeddings: bool = GPTConfig.tie_embeddings  # share the embedding table with the output head, shard for shard
    vocab_size: Optional[int] = None
    # Tokens per chunk of the fused vocab-parallel cross-entropy; None: the head picks one from a memory budget.
    head_chunk_size: Optional[int] = GPTConfig.head_chunk_size
    init: str = GPTConfig.init  # a name from bigdense.INITIALIZERS
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
    sequence_parallel: bool = False  # split LayerNorm/dropout/residual activations along the sequence over TP
    overlap_comm: bool = True  # overlap the column layers' backward collectives with their weight-gradient GEMMs


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
    # The run directory (metrics, logs, checkpoints/). null: a new one per launch, outputs/<date>/<time>
    # or outputs/torchrun-<rendezvous id>. Name one to resume a run, or to extend it with a larger
    # max_steps (the learning-rate schedule then follows the new max_steps; the change is logged).
    run_dir: Optional[str] = None
    log_rms: bool = False  # also log the RMS of every dense layer's weights, activations, gradients
    progress_bar: bool = True
    plot: bool = True  # write loss_curve.png at the end
    init_from: Optional[str] = None  # a checkpoint whose model weights start the run (any TP size; not resumed)
    async_save: bool = True  # snapshot and return; write, hash and fsync in the background
    keep_last: Optional[int] = None  # keep the newest N complete checkpoints (never `latest`); null: keep all
    on_save_error: str = "continue"  # a failed save: "continue" (logged) or "stop"
    checkpoint_verify: str = "node"  # checksums on load: once per "node", "first" reader, "all" readers, "none"
    max_bad_steps: int = 10  # consecutive non-finite steps before rolling back to the last checkpoint (0: never)
    checked_steps: int = 10  # host-side id/label range checks for this many steps, then off (BIGDENSE_CHECKS=1: always)
    compile: bool = False  # torch.compile each transformer block
    compile_backend: str = "inductor"  # "inductor", "aot_eager" (no C++ compiler needed) or "eager"
    tensorboard: bool = False  # also write the metrics as TensorBoard event files in <run dir>/tensorboard
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None: looked up from the GPU's name


@dataclass
class HeadConfig:
    """The classifier head of ``launch/classify.py`` (see `bigdense.ParallelClassifierHead`)."""

    shard: str = "tp"  # "tp" (classes over the TP group) or "world" (over every rank)
    sample_rate: float = 1.0  # in (0, 1]: the share of non-target classes each step scores (Partial FC)
    margin: Any = None  # null, "arcface", "cosface" or [m1, m2, m3]: cos(m1 * theta + m2) - m3
    scale: float = 64.0  # the logit scale of a margin head


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
    head: HeadConfig = field(default_factory=HeadConfig)


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
    check_choice("plan.device_type", plan.device_type, ("cuda", "cpu"))
    for key in ("device_gb", "tflops", "tflops_fp32", "tp_gbps", "dp_gbps", "latency_us", "top"):
        check_positive(f"plan.{key}", getattr(plan, key))
    if plan.devices is not None:
        check_positive("plan.devices", plan.devices)
    if plan.overhead_gb is not None:
        check_positive("plan.overhead_gb", plan.overhead_gb, allow_zero=True)


def run_dir_name(run_dir: Optional[str] = None) -> str:
    """The run directory: ``trainer.run_dir`` when set, else a name under ``outputs/`` that is the
    same on every rank of one launch and across its restarts.

    Under torchrun it is the whole rendezvous id, and nothing else (``--standalone`` makes a fresh
    one per launch; restarts, requeues and relaunches with the same ``--rdzv-id`` keep it, even past
    midnight, so the job finds its own checkpoints); alone, the date and time.
    """
    import re
    import time

    if run_dir:
        return str(run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return "outputs/torchrun-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return time.strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (``conf/config.yaml`` extends ``_train_schema``)
    and the ``bd_run_dir`` resolver the run directory uses."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("bd_run_dir"):
        OmegaConf.register_new_resolver("bd_run_dir", run_dir_name, use_cache=True)
    ConfigStore.instance().store(name="_train_schema", node=TrainConfig)


def validate(cfg, world_size: int, device_type: str) -> None:
    """Every check a person can act on, before any work. ``cfg`` is a TrainConfig or DictConfig.

    Each rule is asked of the code that owns it (the allowed values and ranges live there); what is
    left here are the model's keys and the combinations of groups. Raises `ConfigError`.
    """
    check_known_keys(cfg)
    m = cfg.model
    check_choice("model.name", m.name, MODELS)
    check_choice("model.activation", m.activation, ACTIVATIONS)
    check_choice("model.init", m.init, sorted(INITIALIZERS))
    check_recompute(cfg.recompute.mode, cfg.recompute.every)
    check_precision(cfg.precision, device_type)
    check_engine(EngineSettings.from_run_config(cfg), device_type)  # optimizer and schedule included
    check_data(cfg.data)
    for key in ("model.d_model", "model.n_layers", "model.n_heads", "model.max_seq_len",
                "trainer.log_interval", "trainer.eval_batches", "parallel.timeout_s"):
        group, name = key.split(".")
        check_positive(key, getattr(getattr(cfg, group), name))
    for key in ("trainer.eval_interval", "trainer.save_interval", "trainer.checked_steps"):
        group, name = key.split(".")
        check_positive(key, getattr(getattr(cfg, group), name), allow_zero=True)
    for key in ("d_hidden", "head_chunk_size"):  # None: the model's own choice
        if getattr(m, key) is not None:
            check_positive(f"model.{key}", getattr(m, key))
    check_compile(cfg.trainer.compile_backend)
    if cfg.trainer.peak_tflops is not None:
        check_positive("trainer.peak_tflops", cfg.trainer.peak_tflops)
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
    check_checkpointing(cfg.trainer)
    init_from = getattr(cfg.trainer, "init_from", None)
    if init_from and not os.path.exists(os.path.expanduser(str(init_from))):
        raise ConfigError(f"trainer.init_from={init_from!r} does not exist")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")

    tp = ParallelDims.resolve(cfg.parallel.tp, cfg.parallel.dp, world_size).tp
    check_heads(m.d_model, m.n_heads, tp, key="model.", tp_key="parallel.tp")
    _validate_head(cfg)


def _validate_head(cfg) -> None:
    """The head's own rules (from `bigdense.layers`), reported under their config keys."""
    from .layers.head_modes import SHARD_MODES
    from .layers.margin import resolve_margin
    from .layers.sampling import check_sample_rate

    head = cfg.head
    check_choice("head.shard", head.shard, SHARD_MODES)
    margin = head.margin if head.margin is None or isinstance(head.margin, str) else tuple(head.margin)
    for key, check in (("head.sample_rate", lambda: check_sample_rate(head.sample_rate, "head")),
                       ("head.margin", lambda: resolve_margin(margin, head.scale, "head"))):
        try:
            check()
        except ValueError as err:
            raise ConfigError(f"{key}={getattr(head, key.split('.')[1])!r}: {err}") from None
