"""The engine interface the training loop uses, its settings, and the pieces the engines share.

    settings = EngineSettings.from_run_config(cfg)       # or EngineSettings(engine=..., optim=..., ...)
    engine = bd.build_engine(model, ctx, settings)
    result = engine.train_step([(x, y), ...])   # grad_accum micro-batches -> one optimizer step
    val = engine.eval_loss(x, y)

The model's forward is ``loss = model(x, y)``, the mean loss of the micro-batch's counted targets
(a scalar): those of ``y`` that are not `IGNORE_INDEX` (-100). Micro-batch ``i`` on DP rank ``d`` is
read as rows ``[d * B, (d + 1) * B)`` of a global micro-batch of ``dp_size * B`` rows
(`batch_slice`), so dropout masks do not depend on the DP size: a tp=2 x dp=2 run draws the masks a
single process draws on the concatenated batch.

The loss of a step is weighted by tokens, as Hugging Face's Trainer weighs it with
``num_items_in_batch``: the sum over every counted target of the step -- all its micro-batches, all
DP ranks -- divided by their number (`TokenWeights`). A micro-batch with fewer counted targets (a
masked prompt, padding) then weighs less, and the step equals one batch holding all its tokens
however they are masked and split; with none ignored every micro-batch weighs the same, as a plain
mean of means. The counts are read from ``y`` on the device (one all-reduce of a scalar over DP),
with no host synchronisation.

Every engine skips a step whose gradients hold an inf or nan on any rank on every rank (weights,
optimizer state and LR schedule untouched), reporting ``skipped=True``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ...parallel import comm
from ...parallel.context import ParallelContext
from ...parallel.dropout import batch_slice
from ...errors import ConfigError, check_choice, check_positive, check_positive_int
from ..precision import autocast
from ..cuda_graphs import check_cuda_graphs
from ...muon import check_muon_options
from ..schedule import check_schedule


IGNORE_INDEX = -100  # a target of ``y`` that no loss counts (a masked prompt, padding)


class StepResult:
    """What one optimizer step reports, the same on every rank.

    ``loss`` (the step's token-weighted mean loss over its micro-batches and DP ranks),
    ``grad_norm`` (global, before clipping; inf/nan when the step was skipped for it), ``skipped``
    (no update happened: overflow or non-finite gradients on some rank), ``lr`` (the learning rate
    this step used, or would have used), ``loss_scale`` (fp16's scale this step; 1.0 for
    fp32/bf16), ``tokens`` (the step's counted targets over every DP rank), ``accuracy`` (the share
    of the tokens the fused losses counted whose target is the largest logit) and ``z_loss`` (their
    mean z-loss term) are Python numbers; ``accuracy`` and ``z_loss`` are nan when the model has no
    fused loss (`bigdense.layers.head.metrics`). The DDP engine hands them over as 0-dim device
    tensors, in ``raw``: reading an attribute waits for the step to finish on the device, so a
    training loop sums ``raw`` values on the device and reads once per log interval.
    """

    FIELDS = ("loss", "grad_norm", "skipped", "lr", "loss_scale", "tokens", "accuracy", "z_loss")

    def __init__(self, loss, grad_norm, skipped, lr, loss_scale, tokens=None, accuracy=None, z_loss=None):
        self.raw = dict(loss=loss, grad_norm=grad_norm, skipped=skipped, lr=lr, loss_scale=loss_scale,
                        tokens=_nan_if_none(tokens), accuracy=_nan_if_none(accuracy), z_loss=_nan_if_none(z_loss))

    loss = property(lambda self: float(self.raw["loss"]))
    grad_norm = property(lambda self: float(self.raw["grad_norm"]))
    skipped = property(lambda self: bool(self.raw["skipped"]))
    lr = property(lambda self: float(self.raw["lr"]))
    loss_scale = property(lambda self: float(self.raw["loss_scale"]))
    tokens = property(lambda self: float(self.raw["tokens"]))
    accuracy = property(lambda self: float(self.raw["accuracy"]))
    z_loss = property(lambda self: float(self.raw["z_loss"]))

    def __repr__(self) -> str:
        return "StepResult(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.FIELDS) + ")"


def _nan_if_none(value):
    """A field nobody measured: nan, as a tensor like the others may be (a recorded CUDA graph step
    copies every field into the tensors it recorded)."""
    return torch.tensor(float("nan")) if value is None else value


class TokenWeights:
    """The token weighting of one step (see the module docstring): ``factors[i]`` multiplies
    micro-batch ``i``'s mean loss before it is divided by the number of micro-batches ``n``;
    ``tokens`` is the step's count over every DP rank (a device scalar).

    ``factor_i = c_i * n * dp / total``, with ``c_i`` micro-batch ``i``'s counted targets on this
    rank and ``total`` their sum over the micro-batches and the DP group; DP averaging (divide by
    dp) and the division by ``n`` then leave ``sum_i mean_i * c_i / total``. Integer counts make the
    factor exactly 1.0 when every micro-batch counts the same targets, so such a step is bit for bit
    the plain mean of means. A micro-batch that counts none keeps the factor 1.0: its loss and
    gradients are 0 whatever it is scaled by, and a head that divides a rank's incoming gradient by
    its factor (`bigdense.layers.head.metrics.loss_factor`) must not divide by 0."""

    def __init__(self, micro_batches, dp_group):
        counts = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches])
        total = counts.sum()
        if comm.group_size(dp_group) > 1:
            total = comm.all_reduce_(total, dp_group)
        n, dp = len(micro_batches), comm.group_size(dp_group)
        self.tokens = total.float()
        factors = (counts * (n * dp)).double().div(total.clamp(min=1).double()).float()
        self.factors = torch.where(counts == 0, 1.0, factors)


@dataclass(frozen=True)
class EngineSettings:
    """Everything an engine reads from the run's configuration, in one object.

    ``engine``, ``optim`` and ``precision`` are the config groups (`bigdense.config.EngineConfig`,
    `OptimConfig`, `PrecisionConfig`, or anything with their fields); the rest come from ``data``
    and ``trainer`` (``cuda_graphs``: replay the step as a CUDA graph, `bigdense.train.cuda_graphs`).
    """

    engine: Any
    optim: Any
    precision: Any
    micro_batch_size: int
    max_steps: int
    grad_accum: int = 1
    cuda_graphs: bool = False

    def __post_init__(self):
        check_positive_int("data.micro_batch_size", self.micro_batch_size, ConfigError)
        check_positive_int("data.grad_accum", self.grad_accum, ConfigError)
        check_positive_int("trainer.max_steps", self.max_steps, ConfigError)
        check_optim(self.optim)

    @classmethod
    def from_run_config(cls, cfg) -> "EngineSettings":
        """The settings of a whole training config (`bigdense.config.TrainConfig`)."""
        return cls(engine=cfg.engine, optim=cfg.optim, precision=cfg.precision,
                   micro_batch_size=cfg.data.micro_batch_size, grad_accum=cfg.data.grad_accum,
                   max_steps=cfg.trainer.max_steps, cuda_graphs=bool(getattr(cfg.trainer, "cuda_graphs", False)))


# optim.name: torch's AdamW (DeepSpeed's "torch_adam" in the DeepSpeed engine), or Muon for the dense
# layers' weights and AdamW for the rest (`bigdense.muon`; DDP and FSDP engines)
OPTIMIZERS = ("adamw", "muon")


def check_optim(optim_cfg) -> None:
    """The optimizer's rules (the schedule's are `schedule.check_schedule`'s, Muon's `check_muon_options`)."""
    check_choice("optim.name", str(optim_cfg.name), OPTIMIZERS)
    if str(optim_cfg.name) == "muon":
        check_muon_options(optim_cfg)
    betas = list(optim_cfg.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {betas}")
    check_positive("optim.eps", optim_cfg.eps)
    for key in ("weight_decay", "grad_clip"):
        check_positive(f"optim.{key}", getattr(optim_cfg, key), allow_zero=True)
    check_schedule(optim_cfg)


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


class Engine:
    """The interface the training loop uses; `DDPEngine`, `DSEngine` and `FSDPEngine` implement it.

    Attributes: ``model`` (the unwrapped bigdense model), ``optimizer``, ``scheduler`` (a
    ``LambdaLR``), ``scaler`` (`DynamicLossScaler` for DDP fp16, else None), ``ctx``, ``kind``,
    ``settings`` (the `EngineSettings` it was built from).
    """

    kind: str

    @classmethod
    def check_config(cls, settings: EngineSettings, device_type: str) -> None:
        """Rules this engine adds to the settings' own (raises `ConfigError`); called on construction."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, settings: EngineSettings):
        type(self).check_config(settings, ctx.device.type)
        check_cuda_graphs(settings.cuda_graphs, device_type=ctx.device.type, engine=self.kind, world_size=ctx.world_size)
        self.model = model
        self.ctx = ctx
        self.settings = settings
        self.micro_batch_size = settings.micro_batch_size
        self.grad_accum = settings.grad_accum
        self.precision_name = str(settings.precision.dtype)
        self.scaler = None
        self.optimizer = None
        self.scheduler = None

    # ---- the loop's interface ----
    def train_step(self, micro_batches: Sequence[tuple]) -> StepResult:
        raise NotImplementedError

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        """Mean loss of ``model(x, y)`` in eval mode (no dropout), autocast, over the DP group's
        counted targets (`eval_loss_and_tokens`)."""
        return self.eval_loss_and_tokens(x, y)[0]

    def eval_loss_and_tokens(self, x, y) -> tuple[float, int]:
        """``(mean loss, counted targets)`` of the DP group's batches in eval mode: each rank's mean
        weighted by its counted targets (`TokenWeights`; the plain mean over DP when they are equal)."""
        was_training = self.model.training
        self.model.eval()
        try:
            y = self._to_device(y)
            with self._compute_context():
                loss = self._check_loss(self.model(self._to_device(x), y))
        finally:
            self.model.train(was_training)
        weights = TokenWeights([(x, y)], self.ctx.dp_group)
        return self._dp_mean(loss.detach().float() * weights.factors[0]), int(weights.tokens.item())

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

    def _report(self, loss_sum: torch.Tensor, n: int, weights: TokenWeights, seen) -> dict:
        """The step's reported ``loss``, ``tokens``, ``accuracy`` and ``z_loss`` (device scalars)
        from this rank's weighted ``loss_sum`` over ``n`` micro-batches and the collected counts of
        its fused losses (``seen``, `collect_loss_metrics`'s): one all-reduce over DP."""
        counted = seen.totals if seen.totals is not None else loss_sum.new_zeros(3)
        sums = torch.cat([(loss_sum / n).reshape(1), counted.float()])
        if self.ctx.dp_size > 1:
            sums = comm.all_reduce_(sums, self.ctx.dp_group)
        return dict(loss=sums[0] / self.ctx.dp_size, tokens=weights.tokens, accuracy=sums[2] / sums[1],
                    z_loss=sums[3] / sums[1])

    def _dp_mean_tensor(self, value: torch.Tensor) -> torch.Tensor:
        if self.ctx.dp_size > 1:
            value = comm.all_reduce_(value.clone(), self.ctx.dp_group) / self.ctx.dp_size
        return value

    def _dp_mean(self, value: torch.Tensor) -> float:
        return float(self._dp_mean_tensor(value).item())
