"""From the training job's Hydra config to a `Layout`, an `Estimate`, and ranked layouts that fit.

The config is checked by the training job's own `bigdense.config.validate`, for the planned
number of devices, so the planner refuses exactly what the job would. Candidates of `suggest` are checked the same way before they are estimated.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from omegaconf import OmegaConf

from ..config import ConfigError, validate, validate_plan
from ..parallel.context import ParallelDims
from .estimate import GiB, Estimate, estimate, model_shape
from .hf import meta_causal_lm
from .layout import Layout
from .muon import MuonSettings, muon_time


def planned_devices(cfg, plan) -> int:
    if plan.devices is not None:
        return int(plan.devices)
    tp, dp = cfg.parallel.tp, cfg.parallel.dp
    return int(tp or 1) * int(dp or 1)


def check(cfg, plan) -> int:
    """Validate ``cfg`` as `launch/train.py` would on ``plan.devices`` processes; return that count."""
    validate_plan(plan)
    devices = planned_devices(cfg, plan)
    # The bf16 capability check reads the local GPU; a plan for remote GPUs cannot make it.
    local = plan.device_type if (plan.device_type == "cpu" or torch.cuda.is_available()) else "remote"
    validate(cfg, devices, local)  # the data group's rules included
    return devices


def layout_of(cfg, plan, devices: int) -> Layout:
    dims = ParallelDims.resolve(cfg.parallel.tp, cfg.parallel.dp, devices)
    return Layout(
        tp=dims.tp, dp=dims.dp,
        precision=str(cfg.precision.dtype), engine=str(cfg.engine.kind),
        # Each engine's own keys; the defaults elsewhere (what `candidates` sets).
        zero_stage=int(cfg.engine.zero_stage) if cfg.engine.kind == "deepspeed" else 0,
        dp_replicate=int(cfg.engine.dp_replicate) if cfg.engine.kind == "fsdp" else 1,
        reshard_after_forward=bool(cfg.engine.reshard_after_forward) if cfg.engine.kind == "fsdp" else True,
        micro_batch_size=int(cfg.data.micro_batch_size), grad_accum=int(cfg.data.grad_accum),
        recompute=str(cfg.recompute.mode), recompute_every=int(cfg.recompute.every),
        sequence_parallel=bool(getattr(cfg.parallel, "sequence_parallel", False)),
        device_type=str(plan.device_type),
    )


def meta_gpt(cfg):
    """The reference GPT of ``cfg.model`` on the meta device (global shapes, nothing allocated),
    with the run's adapters (`with_adapters`)."""
    from ..models import GPT, GPTConfig

    with torch.device("meta"):  # (its qkv's block indices stay on the CPU: Muon's geometry reads them)
        model = GPT(GPTConfig.from_config(cfg.model, int(cfg.data.vocab_size)))
    return with_adapters(model, cfg)


def meta_hf(cfg):
    """``model=hf``: the Hugging Face causal LM of ``model.path`` on the meta device, in the job's
    `CausalLM`, its embeddings frozen with ``model.freeze_embeddings``, its loss on the fused path
    unless ``model.fused_loss=false``, with the run's adapters (`with_adapters`; only config.json
    is read, and a ``model.adapter`` directory's adapter_config.json)."""
    model = meta_causal_lm(cfg.model.path, fused_loss=bool(cfg.model.fused_loss))
    model = with_adapters(model, cfg)
    if cfg.model.freeze_embeddings:  # after the adapters, as the job freezes them
        model.freeze_embeddings()
    return model


def with_adapters(model, cfg):
    """``model`` (on the meta device) given the run's low-rank adapters by the job's own
    `apply_adapters` (``lora.r`` > 0 or ``model.adapter``: factors added, the base frozen, its
    weights cast to ``lora.base_dtype``); unchanged without. The meta model of a Hugging Face
    fine-tune is not converted, so its adapters sit on plain layers: `bigdense.plan.count` splits
    them as they split on the converted layers at the planned TP size."""
    from ..jobs.parallelize import apply_adapters

    apply_adapters(model, cfg)
    return model


def meta_model(cfg):
    """The model the job of ``cfg`` trains, on the meta device."""
    return meta_hf(cfg) if cfg.model.name == "hf" else meta_gpt(cfg)


def _overhead_gb(plan) -> float:
    if plan.overhead_gb is not None:
        return float(plan.overhead_gb)
    return 1.0 if plan.device_type == "cuda" else 0.0


def step_time(est: Estimate, model_shape, plan) -> float:
    """A rough step time for ranking layouts: matmul FLOPs at ``plan.tflops`` plus ring all-reduces
    (TP: `Estimate.tp_collective_bytes`, the residual stream's 4 per block per micro-batch plus
    recompute's and the adapters' (tokens, r), each ring step of the stream's paying
    ``plan.latency_us``, so fewer, larger micro-batches win ties; DP: the gradients); with Muon its
    step beyond AdamW's (`muon.muon_time`: Newton-Schulz at the rate of its dtype, the exchange at
    ``plan.dp_gbps``)."""
    lay = est.layout
    rate = (plan.tflops_fp32 if lay.precision == "fp32" else plan.tflops) * 1e12
    compute = est.flops_per_step / rate
    per_block = 4 + {"none": 0, "mlp": 1, "full": 2, "every_k": 2 / lay.recompute_every}[lay.recompute]
    tp_calls = (per_block * model_shape.n_layers + 2) * lay.grad_accum * 2 * (lay.tp - 1)  # ring steps
    tp_time = 2 * (lay.tp - 1) / lay.tp * est.tp_collective_bytes / (plan.tp_gbps * 1e9) \
        + tp_calls * plan.latency_us * 1e-6
    muon = 0.0
    if est.muon is not None:
        ns_rate = plan.tflops if est.muon.ns_dtype == "bf16" else plan.tflops_fp32
        muon = muon_time(est.muon, ns_rate, plan.dp_gbps, plan.latency_us)
    return compute + tp_time + _dp_bytes(est) / (plan.dp_gbps * 1e9) + muon


def _dp_bytes(est: Estimate) -> float:
    """Bytes one rank moves over DP per step: a ring all-reduce of the fp32 gradients of the
    parameters that train (DDP, DeepSpeed); FSDP: an all-gather of the parameters in the compute dtype in each micro-batch's
    forward (and backward, when it reshards after the forward), one reduce-scatter of the fp32
    gradients, and with HSDP a ring all-reduce of the gradient shards over the replicas."""
    lay = est.layout
    if lay.engine != "fsdp":
        return 2 * (lay.dp - 1) / lay.dp * est.trainable_per_rank * 4
    ws, replicas = lay.dp_shard, lay.dp_replicate
    shard, trained = est.params_per_rank, est.trainable_per_rank  # fsdp: shard elements
    gathers = (2 if lay.reshard_after_forward else 1) * lay.grad_accum
    # elements through a rank in one ring all-gather (every parameter) or reduce-scatter (those that train)
    return (ws - 1) * (shard * gathers * lay.param_bytes + trained * 4) + 2 * (replicas - 1) / replicas * trained * 4


def estimate_config(cfg, plan, layout: Optional[Layout] = None, model=None) -> Estimate:
    """The estimate of the job ``cfg`` describes (or of ``layout`` over the same model and data)."""
    devices = check(cfg, plan)
    layout = layout or layout_of(cfg, plan, devices)
    model = model if model is not None else meta_model(cfg)
    seq_len = int(cfg.data.seq_len)
    est = estimate(model, layout=layout, seq_len=seq_len, overhead_gb=_overhead_gb(plan),
                   muon=MuonSettings.of(cfg.optim))
    est.step_time_s = step_time(est, model_shape(model, seq_len), plan)
    return est


def _with_layout(cfg, layout: Layout):
    out = copy.deepcopy(cfg)
    for key, value in layout.config_values().items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def _engines(dp: int) -> list[dict]:
    """The engine settings worth trying over ``dp`` ranks: DDP; with dp > 1 ZeRO-1/2 and FSDP
    (resharding after the forward or not), and HSDP over each proper split of dp."""
    out = [dict(engine="ddp", zero_stage=0, dp_replicate=1, reshard_after_forward=True)]
    if dp > 1:
        out += [dict(engine="deepspeed", zero_stage=z, dp_replicate=1, reshard_after_forward=True) for z in (1, 2)]
        out += [dict(engine="fsdp", zero_stage=0, dp_replicate=r, reshard_after_forward=reshard)
                for r in range(1, dp) if dp % r == 0 for reshard in (True, False)]
    return out


def candidates(cfg, devices: int, base: Layout) -> list[Layout]:
    """Layouts of the same devices and global batch: tp x dp, micro-batch, recompute, engine (DDP,
    ZeRO, FSDP, HSDP), SP."""
    global_batch = base.micro_batch_size * base.grad_accum * base.dp
    # Sequence parallelism is the reference GPT's (`GPTConfig.from_config`); `bd.parallelize` has none.
    gpt = cfg.model.name != "hf"
    sp_options = (False, True) if gpt and hasattr(cfg.parallel, "sequence_parallel") else (False,)
    out = []
    for tp in [t for t in range(1, devices + 1) if devices % t == 0]:
        dp = devices // tp
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
            for mode in ("none", "mlp", "full"):
                for engine in _engines(dp):
                    for sp in sp_options if tp > 1 else (False,):
                        out.append(base.with_(tp=tp, dp=dp, micro_batch_size=micro, grad_accum=per_rank // micro,
                                              recompute=mode, sequence_parallel=sp, **engine))
    return out


def suggest(cfg, plan) -> list[Estimate]:
    """The layouts that fit ``plan.device_gb``, fastest (estimated) first; refused ones are skipped."""
    validate_plan(plan)
    devices = planned_devices(cfg, plan)  # the config's own layout need not be valid, only the candidates
    base = layout_of(cfg, plan, devices)
    model = meta_model(cfg)
    fitting = []
    for layout in candidates(cfg, devices, base):
        try:
            est = estimate_config(_with_layout(cfg, layout), plan, layout, model)
        except ConfigError:
            continue
        if est.fits(plan.device_gb * GiB):
            fitting.append(est)
    fitting.sort(key=lambda e: (e.step_time_s, e.total_bytes))
    return fitting
