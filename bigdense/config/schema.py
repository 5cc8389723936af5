"""The schemas of the training configuration: one dataclass per Hydra config group, with
documented defaults. ``conf/<group>/<option>.yaml`` files fill them; ``conf/config.yaml`` starts
from `TrainConfig` (registered as ``_train_schema`` by `register_configs`), whose fields are the
groups' dataclasses, so a wrong type fails when Hydra composes the config, naming the key. The
allowed values and ranges are the owning code's (`bigdense.config.validate` asks them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..models import GPTConfig


@dataclass
class ModelConfig:
    """The network. Defaults are `bigdense.models.GPTConfig`'s; ``vocab_size`` defaults to the tokenizer's."""

    # One of bigdense.models.MODELS: "gpt" (launch/train.py), "encoder" (launch/classify.py), "hf" (launch/train.py:
    # a Hugging Face causal LM read from model.path; the shape keys below, d_model to init, do not apply to it)
    name: str = "gpt"
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
    # The GPT's logits are softcap * tanh(z / softcap) (Gemma 2's final_logit_softcapping); null: plain.
    # model=hf: the model's own transform applies (found from the model), this key must stay null.
    softcap: Optional[float] = GPTConfig.softcap
    z_loss: float = GPTConfig.z_loss  # each counted token's loss adds z_loss * lse**2 (PaLM's z-loss); gpt and hf
    init: str = GPTConfig.init  # a name from bigdense.INITIALIZERS
    # {module path: rank} or null: build these dense layers as low-rank pairs (as written by
    # `python -m bigdense.compress`; override syntax: 'model.low_rank={blocks.0.mlp.up:48}').
    # Its "hint" follows its name when a typo's closest key is this one (bigdense.config.keys).
    low_rank: Any = field(default=None, metadata={"hint": (
        "builds the named dense layers as low-rank pairs, as `python -m bigdense.compress` writes them, in their "
        "place; it adds no adapters (low-rank adapters beside frozen layers are the lora group: lora.r=16)")})
    # model.name=hf: a directory written by transformers' save_pretrained (config.json, *.safetensors and,
    # when present, tokenizer.json, whose tokenizer then encodes the data)
    path: Optional[str] = None
    freeze_embeddings: bool = False  # model.name=hf: the input embeddings (and a head tied to them) stay as loaded
    # model.name=hf: the loss through bigdense's fused head (no whole logits), the model's logit transform found
    # and proved when it is converted (bigdense.models.hf_loss); false keeps its logits and F.cross_entropy.
    fused_loss: bool = True
    # A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that starts the run's adapters,
    # to continue training it; its r, alpha, targets, dropout and rsLoRA replace the lora group's.
    adapter: Optional[str] = None


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

    # "fp32", "bf16" or "fp16". On a CPU, bf16 (fp16) is fast only with native matmuls (AVX512-BF16 or AMX;
    # AVX512-FP16 or AMX-FP16); elsewhere torch emulates them, several times slower than fp32 (the log warns).
    dtype: str = "fp32"
    init_scale: float = 65536.0  # fp16 only: dynamic loss scaling
    growth_interval: int = 1000  # fp16: steps without overflow before the scale doubles
    min_scale: float = 1.0


@dataclass
class EngineConfig:
    """Who runs data parallelism and the optimizer step."""

    kind: str = "ddp"  # "ddp" (torch DistributedDataParallel), "deepspeed" or "fsdp" (FSDP2 over DP)
    zero_stage: int = 1  # deepspeed only: 0, 1 or 2 (ZeRO-3's sharded parameters with TP: engine=fsdp)
    bucket_cap_mb: float = 25.0  # ddp only
    reshard_after_forward: bool = True  # fsdp only: free gathered parameters after each block's forward
    dp_replicate: int = 1  # fsdp only: > 1 is HSDP, sharded over dp / dp_replicate ranks, replicated over the rest


@dataclass
class OptimConfig:
    """AdamW, or Muon for the dense layers' weights and AdamW for the rest (``name: muon``), with
    linear warm-up and a cosine (or constant) schedule."""

    name: str = "adamw"  # "adamw" or "muon"
    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" or "constant"
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # name=muon (docs/training.md, "Muon"): torch.optim.Muon's options; lr and weight_decay serve both groups
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    ns_eps: float = 1.0e-7
    adjust_lr: str = "match_rms_adamw"  # "match_rms_adamw", "original" or "none"
    ns_dtype: str = "auto"  # the iteration's dtype: "auto" (bf16 on CUDA, fp32 elsewhere), "fp32" or "bf16"
    ns_compile: str = "auto"  # torch.compile the iteration: "auto" (on CUDA), "on" or "off"
    muon_blocks: str = "split"  # "split": q, k, v and gate, up orthogonalised apart; "whole": each weight whole
    muon_comm: str = "all_to_all"  # moving whole matrices: "all_to_all" (two per round) or "gather" (two per matrix)


@dataclass
class DataConfig:
    """Text for the language model. ``source=stdlib`` reads this Python's own standard library."""

    source: str = "stdlib"  # "stdlib", "files" or "records"
    path: Optional[str] = None  # source=files: a directory (or file) of UTF-8 text; records: a file, directory or glob
    pattern: str = "**/*.py"  # files under the source directory that are read
    max_corpus_mb: float = 24.0  # read at most this much text (sorted file order)
    vocab_size: int = 32768  # byte-level BPE trained locally, cached
    seq_len: int = 128
    micro_batch_size: int = 8  # sequences per data-parallel rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    # Share of files held out for evaluation, in (0, 1); of a single file's text, its tail (docs/training.md)
    val_fraction: float = 0.02
    cache_dir: Optional[str] = None  # None: $BIGDENSE_CACHE or ~/.cache/bigdense
    # source=records (docs/training.md, "Records"): JSON Lines, Parquet, CSV, Arrow or a saved dataset.
    # The record shape is recognised from the fields, or named by one of these keys.
    text_field: Optional[str] = None  # every token a target
    prompt_field: Optional[str] = None  # with completion_field: the prompt masked from the loss
    completion_field: Optional[str] = None
    messages_field: Optional[str] = None  # chats, rendered with the model's chat template
    train_on_prompt: bool = False  # every token a target (prompts and non-assistant turns too)
    pack: bool = True  # examples joined into full rows; false: one example per row, padded
    skip_bad_records: bool = False  # skip (and count) records that cannot be read, instead of stopping
    val_split: Optional[str] = None  # a saved DatasetDict's held-out split (default: validation, else test)
    val_path: Optional[str] = None  # held-out record files (default: data.val_fraction of the records)


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
    # torch.compile: false, "blocks" (each transformer block; true means this) or "model" (the whole
    # forward, embedding to loss, in as few graphs as Dynamo allows)
    compile: Any = False
    cuda_graphs: bool = False  # on CUDA, replay the whole training step as one CUDA graph (engine=ddp)
    compile_backend: str = "inductor"  # "inductor", "aot_eager" (no C++ compiler needed) or "eager"
    tensorboard: bool = False  # also write the metrics as TensorBoard event files in <run dir>/tensorboard
    log_histograms: bool = True  # with tensorboard: also every dense layer's weight and gradient histograms
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None: looked up from the GPU's name


@dataclass
class HeadConfig:
    """The classifier head of ``launch/classify.py`` (see `bigdense.ParallelClassifierHead`)."""

    shard: str = "tp"  # "tp" (classes over the TP group) or "world" (over every rank)
    sample_rate: float = 1.0  # in (0, 1]: the share of non-target classes each step scores (Partial FC)
    margin: Any = None  # null, "arcface", "cosface" or [m1, m2, m3]: cos(m1 * theta + m2) - m3
    scale: float = 64.0  # the logit scale of a margin head
    softcap: Optional[float] = None  # logits softcap * tanh(z / softcap); null: none (not with a margin)
    z_loss: float = 0.0  # each sample's loss adds z_loss * lse**2; 0: none


@dataclass
class PruneConfig:
    """Gradual magnitude pruning during training (`bigdense.compression.prune_schedule`, docs/pruning.md);
    off while ``sparsity`` is 0. Event i = 0 .. steps-1, once start_step + i * every steps are done,
    prunes to sparsity * (1 - (1 - (i + 1) / steps) ** 3) (cubic). engine=ddp only."""

    sparsity: float = 0.0  # the final fraction of the named layers' weights that is zero; 0: off
    structure: str = "unstructured"  # "unstructured" (one global threshold) or "n:m" (sparsity must be 1 - n/m)
    n: int = 2  # n:m: keep n of every m weights along the input dimension
    m: int = 4
    layers: Any = None  # fnmatch patterns of module names (e.g. ['blocks.*.mlp']); null: every dense layer but the head
    start_step: int = 0  # the first event, once this many steps are done
    every: int = 100  # steps between events
    steps: int = 1  # events (1: prune once, at start_step)


@dataclass
class LoRAConfig:
    """Low-rank adapters beside frozen dense layers (`bigdense.layers.lora`, docs/lora.md); off while
    ``r`` is 0 (full fine-tuning). With adapters only they train: the optimizer, gradients, clipping
    and checkpoints hold the adapters (and their state) alone."""

    r: int = 0  # the adapters' rank; 0: no adapters, every weight trains
    alpha: Optional[float] = None  # the scale's numerator (PEFT's lora_alpha); null: r (scale 1)
    dropout: float = 0.0  # dropout of the adapters' input (layout-free masks)
    # module name patterns (PEFT's target_modules: 'q_proj', 'blocks.*.mlp.up') or 'all-linear': every linear
    # layer but the output head (every attention and MLP projection)
    targets: Any = "all-linear"
    rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r (rank-stabilised LoRA)
    # the frozen base's dense weights held in this dtype: null keeps precision.dtype's parameters; "bf16" halves
    # them (with precision=bf16, whose autocast computes in bf16 anyway) while the adapters stay fp32
    base_dtype: Optional[str] = None


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
    prune: PruneConfig = field(default_factory=PruneConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


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
