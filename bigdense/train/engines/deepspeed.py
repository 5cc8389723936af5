"""`DSEngine`: DeepSpeed ZeRO (stage 0-2) with bigdense's TP passed in through `DeepSpeedMPU`.

What bigdense does because of particular DeepSpeed behaviour lives in `ds_compat` (listed there).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ...errors import ConfigError, check_choice
from ...checkpoint.split import OptimizerPair
from ...layers.head.metrics import collect_loss_metrics, loss_factor
from ...parallel.sharding import is_world_sharded
from ..clip import clip_grad_norm_, grad_norm
from ..precision import any_rank
from ..schedule import build_lr_schedule
from . import ds_compat
from .base import Engine, EngineSettings, StepResult, TokenWeights, mesh_group, param_groups
from .world_sharded import WorldShardedAdamW, split_world_sharded

_INPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ZERO_STAGES = (0, 1, 2)  # engine.zero_stage


def _power_of_two(key: str, value: float) -> int:
    exponent = math.log2(value) if value > 0 else float("nan")
    if not (math.isfinite(exponent) and exponent == int(exponent)):
        raise ConfigError(f"{key}={value} must be a power of two for engine.kind=deepspeed (its initial_scale_power)")
    return int(exponent)


def _ds_config(settings: EngineSettings, stage: int, clip_in_deepspeed: bool) -> dict:
    """DeepSpeed's JSON config for these settings (the optimizer entry is added by the caller)."""
    dtype, precision_cfg = str(settings.precision.dtype), settings.precision
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": max(float(settings.optim.grad_clip), 0.0) if clip_in_deepspeed else 0.0,
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
    return config


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
    Under sequence parallelism the layers sum their replicated parameters' partial gradients in
    each backward (DeepSpeed reduces gradients in its own hooks and buffers, so the DDP engine's
    one deferred sum per step, `parallel.partial_grads`, is not used here).

    At ZeRO stage 0 bigdense clips with `clip_grad_norm_` itself (on the DP-averaged gradients,
    before DeepSpeed's step; fp16 gradients are still scaled, so it clips at ``grad_clip * scale``)
    and, in fp32, skips through DeepSpeed's ``optimizer.overflow`` protocol (`ds_compat` 2 and 3).

    Parameters split over every rank (shard spec ``group="world"``: a world-sharded classifier
    head) have no DP replicas, and their layer already produces the gradient DP averaging would
    give. DeepSpeed never holds them: they are out of its optimizer, its start-up broadcast and
    its stage-0 all-reduce (`ds_compat` 8, 9), and `world_sharded.WorldShardedAdamW` steps them
    after DeepSpeed's step, with the same hyper-parameters, groups and learning rate, fp32 masters
    when the module is bf16/fp16, and not at all when DeepSpeed skipped. One global norm counts
    them once: bigdense's at stage 0 (a non-finite one makes DeepSpeed skip: `ds_compat` 11), and
    at ZeRO-1/2 DeepSpeed's own, which includes them, with the same unscale-and-clip factor applied
    to them (`ds_compat` 10). `checkpoint_state` hands both optimizers as one (an ``OptimizerPair``).
    """

    kind = "deepspeed"

    @classmethod
    def check_config(cls, settings: EngineSettings, device_type: str) -> None:
        if settings.engine.zero_stage == 3:
            raise ConfigError("engine.zero_stage=3: DeepSpeed does not train ZeRO-3 with tensor parallelism (its AutoTP "
                              "supports stages 0-2); to shard parameters, gradients and optimizer state over DP too, "
                              "use engine=fsdp (FSDP2 over the DP dimension of the TP x DP mesh)")
        check_choice("engine.zero_stage", settings.engine.zero_stage, ZERO_STAGES)
        if str(settings.optim.name) == "muon":
            raise ConfigError("optim.name=muon with engine=deepspeed: ZeRO flattens the weights into partitions that cut "
                              "matrices at arbitrary elements, and DeepSpeed's own MuonWithAuxAdam orthogonalises each "
                              "tensor-parallel shard apart (not the whole matrix); use engine=ddp or engine=fsdp "
                              "(FSDP2 shards optimizer state over DP as ZeRO does)")
        if settings.precision.dtype == "fp16":
            if device_type == "cpu":
                raise ConfigError("precision=fp16 with engine=deepspeed needs a GPU: DeepSpeed's CPU accelerator has "
                                  "no fp16 support; use precision=bf16, or engine=ddp")
            _power_of_two("precision.init_scale", float(settings.precision.init_scale))

    def __init__(self, model, ctx, settings: EngineSettings):
        super().__init__(model, ctx, settings)
        import deepspeed  # noqa: F401  (fails here, naming the missing package, before any work)

        mpu = ds_compat.DeepSpeedMPU(ctx)
        dtype, optim_cfg = self.precision_name, settings.optim
        stage = int(settings.engine.zero_stage)
        self.grad_clip = float(optim_cfg.grad_clip)
        self.own_clip = ds_compat.bigdense_clips(stage)
        config = _ds_config(settings, stage, clip_in_deepspeed=not self.own_clip)
        adamw = {"lr": float(optim_cfg.lr), "betas": [float(b) for b in optim_cfg.betas], "eps": float(optim_cfg.eps),
                 "weight_decay": float(optim_cfg.weight_decay)}
        # Parameters split over every rank have no DP replicas: DeepSpeed never holds them (`world_sharded`).
        groups, self._groups_from, _, self._world_from = split_world_sharded(
            param_groups(model, optim_cfg.weight_decay))
        world_params = [p for p in model.parameters() if is_world_sharded(p)]
        client_optimizer = None
        if self.own_clip and dtype == "fp32":
            # DeepSpeed hands a client optimizer straight to its fp32 path; this one can be told to skip.
            client_optimizer = ds_compat.SkippableAdamW(groups, **{k: v for k, v in adamw.items() if k != "weight_decay"})
        else:
            config["optimizer"] = {"type": "AdamW", "params": {**adamw, "torch_adam": True}}

        def schedule(optimizer):
            return build_lr_schedule(optimizer, optim_cfg, settings.max_steps)

        self.ds, self.optimizer, _, self.scheduler = ds_compat.initialize(
            ctx, world_sharded=world_params, model=model, model_parameters=groups, optimizer=client_optimizer,
            lr_scheduler=schedule, config=config, mpu=mpu, dist_init_required=False,
        )
        self.model = self.ds.module
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        ds_compat.link_zero_state(self.optimizer)
        self._input_dtype = _INPUT_DTYPES.get(dtype)
        self.world = None
        if world_params:  # built now, from the parameters in DeepSpeed's dtype
            world_groups = split_world_sharded(param_groups(self.model, optim_cfg.weight_decay))[2]
            self.world = WorldShardedAdamW(world_groups, **{k: v for k, v in adamw.items() if k != "weight_decay"})
            ds_compat.keep_out_of_dp_reduction(self.ds, self.world.params)
            if not self.own_clip:
                ds_compat.add_to_norm(self.optimizer, lambda: self._world_norm)
            elif not isinstance(self.optimizer, ds_compat.SkippableAdamW):
                ds_compat.skip_when(self.optimizer, lambda: self._nonfinite)
        self._world_norm, self._nonfinite = None, False

    def _compute_context(self):
        return contextlib.nullcontext()  # DeepSpeed's bf16/fp16 weights set the compute dtype

    def _to_device(self, t):
        t = super()._to_device(t)
        if self._input_dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.to(self._input_dtype)
        return t

    def _loss_scale(self) -> float:
        return ds_compat.loss_scale(self.optimizer) if self.precision_name == "fp16" else 1.0

    def train_step(self, micro_batches) -> StepResult:
        micro_batches = self._check_micro_batches(micro_batches)
        self.ds.train()
        if self.world is not None:
            self.world.zero_grad()
        n = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        loss_scale, lr, norm = self._loss_scale(), float(self.ds.get_lr()[0]), None
        weights = TokenWeights(micro_batches, self.ctx.dp_group)
        with collect_loss_metrics() as seen:
            for i, (x, y) in enumerate(micro_batches):
                with self._batch_slice(), loss_factor(weights.factors[i]):
                    loss = self._check_loss(self.ds(x, y))
                loss_sum += loss.detach().float() * weights.factors[i]
                # DeepSpeed divides by gradient_accumulation_steps and averages over DP.
                self.ds.backward(loss * weights.factors[i].to(loss.dtype))
                if i == n - 1:  # boundary: DeepSpeed has all-reduced its gradients over DP in backward()
                    norm = self._boundary(loss_scale)
                self.ds.step()
        skipped = not self.ds.was_step_applied()
        if self.world is not None and not skipped:
            # (at stage 0 bigdense clipped them with the others; fp16's are still loss-scaled)
            factor = 1.0 / loss_scale if self.own_clip else ds_compat.zero_grad_factor(self.optimizer, self.grad_clip,
                                                                                      loss_scale)
            self.world.step(lr, None if factor == 1.0 else factor)
        if norm is None:
            reported = self.ds.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
        report = {k: float(v) for k, v in self._report(loss_sum, n, weights, seen).items()}
        return StepResult(report.pop("loss"), norm, bool(skipped), lr, loss_scale, **report)

    def _boundary(self, loss_scale: float):
        """Before DeepSpeed's step: bigdense's clipping where it clips (returns the norm), else the
        world-sharded gradients' norm for DeepSpeed's (`ds_compat.add_to_norm`); then the
        world-sharded gradients leave the module, where DeepSpeed's step would clear them."""
        norm = None
        if self.own_clip:  # the world-sharded gradients are clipped here with the others
            total = (clip_grad_norm_(self._params, self.grad_clip * loss_scale, tp_group=self.ctx.tp_group)
                     if self.grad_clip > 0 else grad_norm(self._params, tp_group=self.ctx.tp_group))
            norm = float(total) / loss_scale
            self._nonfinite = not math.isfinite(norm)  # the same on every rank: the norm is global
            if isinstance(self.optimizer, ds_compat.SkippableAdamW):
                self.optimizer.overflow = any_rank(self._nonfinite, mesh_group(self.ctx), self.ctx.device)
        elif self.world is not None:
            self._world_norm = grad_norm(self.world.params, tp_group=self.ctx.tp_group)
        if self.world is not None:
            self.world.take_grads()
        return norm

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def checkpoint_state(self) -> dict:
        """As `Engine.checkpoint_state`, but ``model`` is DeepSpeed's engine (``bd.save_checkpoint``
        reads its optimizer through DeepSpeed's per-parameter API, fp32 masters included) and
        ``optimizer`` DeepSpeed's optimizer -- with world-sharded parameters an ``OptimizerPair`` of
        it and theirs, saved as the one AdamW the DDP engine has; DeepSpeed keeps any fp16 loss
        scale itself."""
        optimizer = self.optimizer
        if self.world is not None:
            optimizer = OptimizerPair(self.optimizer, self.world, self._groups_from, self._world_from)
        return {"model": self.ds, "optimizer": optimizer, "scheduler": self.scheduler, "scaler": None}
