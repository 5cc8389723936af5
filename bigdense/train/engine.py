"""Training engines: one interface for the loop, over torch DDP or DeepSpeed.

    engine = bd.build_engine(model, ctx, engine_cfg=cfg.engine, optim_cfg=cfg.optim,
                             precision_cfg=cfg.precision, micro_batch_size=cfg.data.micro_batch_size,
                             grad_accum=cfg.data.grad_accum, max_steps=cfg.trainer.max_steps)
    result = engine.train_step([(x, y), ...])   # grad_accum micro-batches -> one optimizer step
    val = engine.eval_loss(x, y)

The model's forward is ``loss = model(x, y)``, the mean loss of the micro-batch (a scalar).
Micro-batch ``i`` on DP rank ``d`` is read as rows ``[d * B, (d + 1) * B)`` of a global micro-batch
of ``dp_size * B`` rows (`batch_slice`), so dropout masks do not depend on the DP size: a tp=2 x dp=2
run draws the masks a single process draws on the concatenated batch.

Both engines average the loss over the micro-batches and then over DP for reporting, and skip a
step whose gradients hold an inf or nan on any rank on every rank (weights, optimizer state and LR
schedule untouched), reporting ``skipped=True``. Precision: the DDP engine keeps fp32 parameters
and computes under autocast; the DeepSpeed engine uses DeepSpeed's own bf16/fp16 (see there).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.context import ParallelContext, get_default_context
from ..parallel.random import batch_slice
from .clip import clip_grad_norm_
from .precision import Precision, any_rank, autocast
from .schedule import build_lr_schedule

ENGINES = ("ddp", "deepspeed")


@dataclass
class StepResult:
    """What one optimizer step reports, the same on every rank."""

    loss: float  # mean over the step's micro-batches and over DP
    grad_norm: float  # global gradient norm before clipping (inf/nan when the step was skipped for it)
    skipped: bool  # no update happened (overflow or non-finite gradients on some rank)
    lr: float  # the learning rate this step used (or would have used)
    loss_scale: float  # the fp16 loss scale this step used; 1.0 for fp32/bf16


def mesh_group(ctx: ParallelContext) -> Optional[dist.ProcessGroup]:
    """The group spanning the whole TP x DP mesh (the world when distributed; None alone)."""
    return dist.group.WORLD if ctx.is_distributed else None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (dim >= 2), none on biases and norm gains."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed cannot flatten an empty group


def _check_optim(optim_cfg) -> None:
    if str(optim_cfg.name) != "adamw":
        raise ValueError(f"optim.name={optim_cfg.name!r} is not one of ['adamw']")


class Engine:
    """The interface the training loop uses; `DDPEngine` and `DSEngine` implement it.

    Attributes: ``model`` (the unwrapped bigdense model), ``optimizer``, ``scheduler`` (a
    ``LambdaLR``), ``scaler`` (`DynamicLossScaler` for DDP fp16, else None), ``ctx``, ``kind``.
    """

    kind: str

    def __init__(self, model: nn.Module, ctx: ParallelContext, precision_cfg, micro_batch_size: int, grad_accum: int):
        for key, value in (("data.micro_batch_size", micro_batch_size), ("data.grad_accum", grad_accum)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        self.model = model
        self.ctx = ctx
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.precision_name = str(precision_cfg.dtype)
        self.scaler = None
        self.optimizer = None
        self.scheduler = None

    # ---- the loop's interface ----
    def train_step(self, micro_batches: Sequence[tuple]) -> StepResult:
        raise NotImplementedError

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        """Mean loss of ``model(x, y)`` in eval mode (no dropout), autocast, averaged over DP."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self._compute_context():
                loss = self._check_loss(self.model(self._to_device(x), self._to_device(y)))
        finally:
            self.model.train(was_training)
        return self._dp_mean(loss.detach().float())

    def checkpoint_state(self) -> dict:
        """``{"model", "optimizer", "scheduler", "scaler"}`` for
        ``bd.save_checkpoint(path, **engine.checkpoint_state(), extra=...)``."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # ---- shared pieces ----
    def _compute_context(self):
        return autocast(self.precision_name, self.ctx.device)

    def _to_device(self, t):
        return t.to(self.ctx.device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    def _check_micro_batches(self, micro_batches) -> list:
        micro_batches = list(micro_batches)
        if len(micro_batches) != self.grad_accum:
            raise ValueError(
                f"{type(self).__name__}.train_step: got {len(micro_batches)} micro-batches, "
                f"expected data.grad_accum={self.grad_accum}"
            )
        out = []
        for i, mb in enumerate(micro_batches):
            if not (isinstance(mb, (tuple, list)) and len(mb) == 2):
                raise TypeError(f"{type(self).__name__}.train_step: micro-batch {i} must be an (x, y) pair")
            x, y = mb
            rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None
            if rows != self.micro_batch_size:
                raise ValueError(
                    f"{type(self).__name__}.train_step: micro-batch {i} has {rows} rows (dim 0 of x), "
                    f"expected data.micro_batch_size={self.micro_batch_size}"
                )
            out.append((self._to_device(x), self._to_device(y)))
        return out

    def _batch_slice(self):
        b = self.micro_batch_size
        return batch_slice(self.ctx.dp_rank * b, self.ctx.dp_size * b)

    @staticmethod
    def _check_loss(loss) -> torch.Tensor:
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"the model's forward must return the mean loss as a scalar (loss = model(x, y)), got {what}"
            )
        return loss

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.ctx.dp_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.ctx.dp_group)
            value /= self.ctx.dp_size
        return float(value.item())


class DDPEngine(Engine):
    """torch ``DistributedDataParallel`` over ``ctx.dp_group`` + AdamW (fp32) + autocast.

    Data parallelism: DDP over the DP group only (never the world, which would average across TP
    shards), and only when ``dp_size > 1``; all micro-batches but the last run under ``no_sync()``,
    so gradients are all-reduced once per step. Then, in order: fp16 unscale (one world all-reduce
    of the found-inf flag), `clip_grad_norm_` with ``optim.grad_clip`` (one TP all-reduce), one world
    all-reduce agreeing on skipping, the AdamW step and the LR schedule (only when not skipped), the
    loss-scale update, and one DP all-reduce of the loss for reporting.
    """

    kind = "ddp"

    def __init__(self, model, ctx, *, engine_cfg, optim_cfg, precision_cfg, micro_batch_size, grad_accum, max_steps):
        super().__init__(model, ctx, precision_cfg, micro_batch_size, grad_accum)
        _check_optim(optim_cfg)
        self.precision = Precision(precision_cfg, ctx.device, group=mesh_group(ctx))
        self.scaler = self.precision.scaler
        self.grad_clip = float(optim_cfg.grad_clip)
        if ctx.dp_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers (masks, tables) are built alike on every rank: no broadcast before each forward.
            # torch 2.13 renamed the switch; older releases only know the old name.
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                              else {"broadcast_buffers": False})
            self.wrapped = DistributedDataParallel(
                model,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.dp_group,
                bucket_cap_mb=float(engine_cfg.bucket_cap_mb),
                gradient_as_bucket_view=True,
                **no_buffer_sync,
            )
        else:
            self.wrapped = model
        self.optimizer = torch.optim.AdamW(
            param_groups(model, optim_cfg.weight_decay), lr=float(optim_cfg.lr),
            betas=tuple(float(b) for b in optim_cfg.betas), eps=float(optim_cfg.eps),
        )
        self.scheduler = build_lr_schedule(self.optimizer, optim_cfg, max_steps)
        self._params = [p for group in self.optimizer.param_groups for p in group["params"]]

    def train_step(self, micro_batches) -> StepResult:
        micro_batches = self._check_micro_batches(micro_batches)
        self.model.train()
        # Cleared here rather than after the step, so the gradients just applied stay readable
        # (the loop's gradient-RMS logging reads them).
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == n - 1
            sync = self.wrapped.no_sync() if (self.wrapped is not self.model and not last) else contextlib.nullcontext()
            with sync:
                with self._batch_slice(), self.precision.autocast():
                    loss = self._check_loss(self.wrapped(x, y))
                loss_sum += loss.detach().float()
                scaled = loss.float() / n
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()

        loss_scale = self.precision.loss_scale
        found_inf = self.scaler.unscale_(self._params) if self.scaler is not None else False
        norm = clip_grad_norm_(self._params, self.grad_clip, tp_group=self.ctx.tp_group)
        skip = any_rank(found_inf or not bool(torch.isfinite(norm)), mesh_group(self.ctx), self.ctx.device)
        lr = self.lr
        if not skip:
            self.optimizer.step()
            self.scheduler.step()
        if self.scaler is not None:
            self.scaler.update(skip)
        return StepResult(self._dp_mean(loss_sum / n), float(norm), bool(skip), lr, loss_scale)


def _link_zero_state(optimizer) -> None:
    """Give each ZeRO flat partition its AdamW state now and link every parameter to its slice.

    torch's AdamW creates state at a group's first step, and DeepSpeed 0.19.8 links parameters to
    it (what ``deepspeed.utils.safe_get_full_optimizer_state``, and so checkpoints, read) once,
    right after stepping the *first* parameter group, before the others have state: parameters of
    the other groups (here the no-decay group) then stay unlinked for good. Zero state with step 0
    is exactly what AdamW would create; with it in place every group links, now and at DeepSpeed's
    own lazy link. Other DeepSpeed optimizers are left alone.
    """
    lp_groups = getattr(optimizer, "bit16_groups", None)
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None)
    inner = getattr(optimizer, "optimizer", None)
    if lp_groups is None or flats is None or not isinstance(inner, torch.optim.Optimizer):
        return
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's choice
    for lps, flat in zip(lp_groups, flats):
        state = inner.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=step_dtype)
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        lazy_init_hp_params_optimizer_state(lps, flat, inner.state)


class _SkippableAdamW(torch.optim.AdamW):
    """torch AdamW honouring DeepSpeed's ``optimizer.overflow`` protocol: DeepSpeed's engine reads
    that attribute after ``step()`` to count a skipped step and hold the LR schedule; its plain
    fp32 (ZeRO-0) path never sets it, so bigdense does."""

    overflow = False

    def step(self, closure=None):
        if self.overflow:
            return None
        return super().step(closure)


def _power_of_two(key: str, value: float) -> int:
    exponent = math.log2(value) if value > 0 else float("nan")
    if not (math.isfinite(exponent) and exponent == int(exponent)):
        raise ValueError(f"{key}={value} must be a power of two for engine.kind=deepspeed (its initial_scale_power)")
    return int(exponent)


class DSEngine(Engine):
    """DeepSpeed (ZeRO stage 0-2) with bigdense TP passed in through `DeepSpeedMPU`.

    ZeRO partitions optimizer state (stage 1) and gradients (stage 2) over ``ctx.dp_group`` only
    and averages gradients over it; its gradient norm and overflow checks are summed over the TP
    group, counting sharded parameters (``tensor_model_parallel``) on every TP rank and replicated
    ones once. Mixed precision is DeepSpeed's own: ``precision=bf16``/``fp16`` make the module's
    parameters bf16/fp16, with fp32 master weights in DeepSpeed's optimizer, and floating-point
    inputs and targets are cast to that dtype (no autocast: autocast would feed fp32 activations to
    bf16 LayerNorm weights); ``fp16`` uses DeepSpeed's dynamic loss scaler, whose overflow check
    is reduced over the DP and TP groups (GPU only: DeepSpeed's CPU accelerator has no fp16).
    So in this engine ``engine.model``'s weights are bf16/fp16 copies; the fp32 masters are
    DeepSpeed's (``deepspeed.utils.safe_get_full_fp32_param``). ``gradient_clipping`` is
    ``optim.grad_clip``; AdamW is DeepSpeed's ``torch_adam`` (torch's AdamW) with the same groups.

    ZeRO stage 0: DeepSpeed 0.19.8's non-ZeRO optimizers compute the clipping norm from gradient
    tensors, which lack ``tensor_model_parallel``, so TP shards on ranks other than 0 are dropped,
    and its fp32 path neither reports a norm nor skips non-finite steps. At stage 0 bigdense
    therefore clips with `clip_grad_norm_` itself (on the DP-averaged gradients, before DeepSpeed's
    step; fp16 gradients are still scaled, so it clips at ``grad_clip * scale``) and, in fp32, skips
    through DeepSpeed's ``optimizer.overflow`` protocol.
    """

    kind = "deepspeed"

    def __init__(self, model, ctx, *, engine_cfg, optim_cfg, precision_cfg, micro_batch_size, grad_accum, max_steps):
        super().__init__(model, ctx, precision_cfg, micro_batch_size, grad_accum)
        _check_optim(optim_cfg)
        import deepspeed

        from .mpu import DeepSpeedMPU

        mpu = DeepSpeedMPU(ctx)
        dtype = self.precision_name
        if dtype == "fp16" and ctx.device.type == "cpu":
            raise ValueError("precision.dtype=fp16 with engine.kind=deepspeed needs a GPU: DeepSpeed's CPU accelerator "
                             "has no fp16; use precision=bf16 or engine=ddp")
        stage = int(engine_cfg.zero_stage)
        if stage not in (0, 1, 2):
            raise ValueError(f"engine.zero_stage={stage} is not one of [0, 1, 2]")
        self.grad_clip = float(optim_cfg.grad_clip)
        self.own_clip = stage == 0
        adamw = {"lr": float(optim_cfg.lr), "betas": [float(b) for b in optim_cfg.betas], "eps": float(optim_cfg.eps),
                 "weight_decay": float(optim_cfg.weight_decay)}
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": grad_accum,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0 if self.own_clip else max(self.grad_clip, 0.0),
            "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": False},
            "steps_per_print": 2**31 - 1,
        }
        if dtype == "fp16":
            config["fp16"] = {
                "enabled": True, "loss_scale": 0,
                "initial_scale_power": _power_of_two("precision.init_scale", float(precision_cfg.init_scale)),
                "loss_scale_window": int(precision_cfg.growth_interval),
                "hysteresis": 1,  # lower the scale at the first overflow, like DynamicLossScaler
                "min_loss_scale": float(precision_cfg.min_scale),
            }
        groups = param_groups(model, optim_cfg.weight_decay)
        client_optimizer = None
        if stage == 0 and dtype == "fp32":
            # DeepSpeed hands a client optimizer straight to its fp32 path; this one can be told to skip.
            client_optimizer = _SkippableAdamW(groups, **{k: v for k, v in adamw.items() if k != "weight_decay"})
        else:
            config["optimizer"] = {"type": "AdamW", "params": {**adamw, "torch_adam": True}}

        def schedule(optimizer):
            return build_lr_schedule(optimizer, optim_cfg, max_steps)

        rng_devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices):  # building the engine must not move dropout's RNG
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=groups, optimizer=client_optimizer, lr_scheduler=schedule,
                config=config, mpu=mpu, dist_init_required=False,
            )
        self.model = self.ds.module
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        _link_zero_state(self.optimizer)
        self._input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)

    def _compute_context(self):
        return contextlib.nullcontext()  # DeepSpeed's bf16/fp16 weights set the compute dtype

    def _to_device(self, t):
        t = super()._to_device(t)
        if self._input_dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.to(self._input_dtype)
        return t

    def _loss_scale(self) -> float:
        if self.precision_name != "fp16":
            return 1.0
        opt = self.optimizer
        scale = getattr(opt, "cur_scale", None)
        if scale is None:
            scale = getattr(getattr(opt, "loss_scale_config", None), "cur_scale", 1.0)
        return float(scale)

    def train_step(self, micro_batches) -> StepResult:
        micro_batches = self._check_micro_batches(micro_batches)
        self.ds.train()
        n = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        loss_scale, lr, norm = self._loss_scale(), float(self.ds.get_lr()[0]), None
        for i, (x, y) in enumerate(micro_batches):
            with self._batch_slice():
                loss = self._check_loss(self.ds(x, y))
            loss_sum += loss.detach().float()
            self.ds.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            if i == n - 1 and self.own_clip:
                # Boundary: DeepSpeed has all-reduced the gradients over DP in backward().
                total = clip_grad_norm_(self._params, self.grad_clip * loss_scale, tp_group=self.ctx.tp_group)
                norm = float(total) / loss_scale
                if isinstance(self.optimizer, _SkippableAdamW):
                    self.optimizer.overflow = any_rank(not math.isfinite(norm), mesh_group(self.ctx), self.ctx.device)
            self.ds.step()
        skipped = not self.ds.was_step_applied()
        if norm is None:
            reported = self.ds.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
        return StepResult(self._dp_mean(loss_sum / n), norm, bool(skipped), lr, loss_scale)

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def checkpoint_state(self) -> dict:
        """As `Engine.checkpoint_state`, but ``model`` is DeepSpeed's engine (``bd.save_checkpoint``
        reads its optimizer through DeepSpeed's per-parameter API, fp32 masters included) and
        ``optimizer`` DeepSpeed's optimizer; DeepSpeed keeps any fp16 loss scale itself."""
        return {"model": self.ds, "optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": None}


def build_engine(
    model: nn.Module,
    ctx: Optional[ParallelContext] = None,
    *,
    engine_cfg,
    optim_cfg,
    precision_cfg,
    micro_batch_size: int,
    grad_accum: int = 1,
    max_steps: int,
) -> Engine:
    """The engine ``engine_cfg.kind`` names, around ``model`` (already on ``ctx.device``).

    Build it after the model is complete (recompute applied, weights tied) and after seeding: the
    engine does not consume the RNG dropout draws from. ``ctx`` defaults to the default context.
    """
    ctx = ctx if ctx is not None else get_default_context()
    kind = str(engine_cfg.kind)
    if kind not in ENGINES:
        raise ValueError(f"engine.kind={kind!r} is not one of {list(ENGINES)}")
    cls = DDPEngine if kind == "ddp" else DSEngine
    return cls(model, ctx, engine_cfg=engine_cfg, optim_cfg=optim_cfg, precision_cfg=precision_cfg,
               micro_batch_size=micro_batch_size, grad_accum=grad_accum, max_steps=max_steps)
