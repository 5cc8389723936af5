"""`DDPEngine`: torch DistributedDataParallel over the DP group, AdamW, bigdense's precision and clipping."""
from __future__ import annotations

import contextlib
import inspect

import torch

import torch.distributed as dist

from ...layers.head.metrics import collect_loss_metrics, loss_factor
from ...layers.base import named_shard_specs
from ...compression.prune_masks import MaskKeeper
from ...parallel import comm
from ...parallel.partial_grads import deferred_partial_grad_sums, partial_grad_params, sum_partial_grads_
from ...errors import check_positive
from ..clip import clip_grad_norm_, grad_norm
from ..cuda_graphs import StepGraph
from ..precision import Precision
from ...muon import Muon, build_muon, muon_param_groups
from ..schedule import build_lr_schedule
from .base import Engine, EngineSettings, StepResult, TokenWeights, mesh_group, param_groups


def _no_buffer_sync(ddp_cls) -> dict:
    """DDP's keyword for "do not broadcast buffers before each forward": torch 2.13 renamed the
    switch (``forward_sync_buffers``); older releases only know ``broadcast_buffers``."""
    if "forward_sync_buffers" in inspect.signature(ddp_cls).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DDPEngine(Engine):
    """torch ``DistributedDataParallel`` over ``ctx.dp_group`` + AdamW (fp32) + autocast.

    Data parallelism: DDP over the DP group only (never the world, which would average across TP
    shards), and only when ``dp_size > 1``; parameters split over every rank (shard spec
    ``group="world"``: a world-sharded classifier head) are left out of its reduction. All
    micro-batches but the last run under ``no_sync()``,
    so gradients are all-reduced once per step. Under sequence parallelism the layers leave the
    partial gradients of their replicated parameters (norms, row biases) for the engine, which
    sums them over TP in one all-reduce after the last backward (`parallel.partial_grads`).
    Each micro-batch's loss is weighted by its counted targets (`TokenWeights`: one all-reduce of
    the step's count over DP before the first forward). Then, in order: fp16 unscale (foreach, a local
    found-inf flag), `clip_grad_norm_` with ``optim.grad_clip`` (foreach, one TP all-reduce), one
    world all-reduce agreeing on skipping, the fused AdamW step and the LR schedule (both held on
    the device when skipped), the pruned weights of masked layers re-zeroed (`bd.apply_masks`),
    the loss-scale update, and one DP all-reduce of the loss and the fused losses' counts for
    reporting. Parameters stay fp32
    and the forward runs under autocast.

    Nothing in ``train_step`` reads the device on the host: the skip decision reaches the optimizer
    as a tensor (fused AdamW's ``found_inf``), the number of applied steps (the LR schedule's
    position) is a device counter from which each step's LR is computed on the device, and the
    returned `StepResult` holds 0-dim tensors. ``scheduler`` (a ``LambdaLR``) is brought up to date
    with the counter, and the param groups' LRs made plain floats again, when `checkpoint_state`
    or ``lr`` is read (a host sync, once per save or log); a loaded scheduler state is taken over
    at the next step.

    With ``settings.cuda_graphs`` (``trainer.cuda_graphs``, one CUDA device) the step is recorded
    once and replayed as a CUDA graph (`bigdense.train.cuda_graphs.StepGraph`); AdamW is then
    ``capturable``.
    """

    kind = "ddp"

    @classmethod
    def check_config(cls, settings: EngineSettings, device_type: str) -> None:
        check_positive("engine.bucket_cap_mb", settings.engine.bucket_cap_mb)

    def __init__(self, model, ctx, settings: EngineSettings):
        super().__init__(model, ctx, settings)
        optim_cfg = settings.optim
        self.precision = Precision(settings.precision, ctx.device, group=mesh_group(ctx))
        self.scaler = self.precision.scaler
        self.grad_clip = float(optim_cfg.grad_clip)
        self.wrapped = self._data_parallel(model)
        self.optimizer = self._build_optimizer(model)
        self.scheduler = build_lr_schedule(self.optimizer, optim_cfg, settings.max_steps)
        self._params = [p for opt in self._optimizers() for group in opt.param_groups for p in group["params"]]
        self._partial = partial_grad_params(model)
        self._applied = torch.zeros((), dtype=torch.int64, device=ctx.device)  # applied optimizer steps
        self._keep_masks = MaskKeeper(model)  # pruned weights back to zero after each step (a no-op without masks)
        self._host_epoch = self.scheduler.last_epoch  # the scheduler's value when it last matched
        self._graph = StepGraph(self._step, self._addresses, ctx.device) if settings.cuda_graphs else None

    def _data_parallel(self, model):
        """``model`` under DDP over the DP group (itself when ``dp_size`` is 1)."""
        if self.ctx.dp_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # A parameter split over every rank (a world-sharded head) has no DP replicas to average.
        world_sharded = [name for name, spec in named_shard_specs(model).items() if spec.group == "world"]
        if world_sharded:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, world_sharded)
        # Buffers (masks, tables) are built alike on every rank: no broadcast before each forward.
        return DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            process_group=self.ctx.dp_group,
            bucket_cap_mb=float(self.settings.engine.bucket_cap_mb),
            gradient_as_bucket_view=True,
            **_no_buffer_sync(DistributedDataParallel),
        )

    def _build_optimizer(self, model) -> torch.optim.Optimizer:
        """``optim.name``'s optimizer over ``model``: AdamW, or `Muon` (dense weights) with AdamW inside."""
        weight_decay = self.settings.optim.weight_decay
        return self._optimizer_over((muon_param_groups if self._muon_run else param_groups)(model, weight_decay))

    @property
    def _muon_run(self) -> bool:
        return str(self.settings.optim.name) == "muon"

    def _optimizer_over(self, groups: list[dict]) -> torch.optim.Optimizer:
        return self._muon(groups) if self._muon_run else self._adamw(groups)

    def _dp_shard(self) -> int:
        """The DP ranks each weight is split over (1: DDP keeps replicas)."""
        return 1

    def _muon(self, groups: list[dict]) -> Muon:
        """`Muon` over ``groups`` (flagged ``"muon"``), exchanging whole matrices over the mesh."""
        return build_muon(self.model, self.ctx, self.settings.optim, groups=groups, dp_shard=self._dp_shard(),
                          group=mesh_group(self.ctx), fused=True, capturable=self.settings.cuda_graphs)

    def _adamw(self, groups: list[dict]) -> torch.optim.AdamW:
        """torch's fused AdamW over ``groups`` with ``optim``'s hyper-parameters."""
        optim_cfg = self.settings.optim
        return torch.optim.AdamW(groups, lr=float(optim_cfg.lr), betas=tuple(float(b) for b in optim_cfg.betas),
                                 eps=float(optim_cfg.eps), fused=True, capturable=self.settings.cuda_graphs)

    def _addresses(self) -> tuple:
        """Where every tensor a recorded step reads and writes across steps lives (`StepGraph`)."""
        tensors = [self._applied] + [p for p in self._params] + [p.grad for p in self._params]
        for opt in self._optimizers():
            tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        if self.scaler is not None:
            tensors += [self.scaler.scale_tensor, self.scaler._tracker]
        return tuple(0 if t is None else t.data_ptr() for t in tensors)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers stepped together (one here; `FSDPEngine` may add one)."""
        return [self.optimizer]

    def _gradient_sync(self, last: bool):
        """The context a micro-batch's forward and backward run in: DP reduction only in the last."""
        if self.wrapped is self.model or last:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def train_step(self, micro_batches) -> StepResult:
        micro_batches = self._check_micro_batches(micro_batches)
        if self._graph is not None:
            self._take_loaded_schedule()  # outside the graph: it may refill the step counter
            return self._graph.step(micro_batches)
        return self._step(micro_batches)

    def _step(self, micro_batches) -> StepResult:
        """One optimizer step over ``micro_batches`` (on the device already); what `StepGraph` records."""
        self.model.train()
        # Cleared here rather than after the step, so the gradients just applied stay readable
        # (the loop's gradient-RMS logging reads them).
        for opt in self._optimizers():
            opt.zero_grad(set_to_none=True)
        n = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        weights = TokenWeights(micro_batches, self.ctx.dp_group)
        with deferred_partial_grad_sums() if self._partial else contextlib.nullcontext(), \
                collect_loss_metrics() as seen:
            for i, (x, y) in enumerate(micro_batches):
                with self._gradient_sync(last=i == n - 1):
                    with self._batch_slice(), self.precision.autocast(), loss_factor(weights.factors[i]):
                        loss = self._check_loss(self.wrapped(x, y))
                    loss_sum += loss.detach().float() * weights.factors[i]
                    scaled = loss.float() / n * weights.factors[i]
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    scaled.backward()
        sum_partial_grads_(self._partial)

        loss_scale = self.scaler.scale_tensor.clone() if self.scaler is not None else torch.ones((), device=loss_sum.device)
        bad = torch.zeros((), dtype=torch.float32, device=loss_sum.device)
        if self.scaler is not None:
            bad = self.scaler.unscale_and_check_(self._params)
        if self.grad_clip > 0:
            norm = clip_grad_norm_(self._params, self.grad_clip, tp_group=self.ctx.tp_group)
        else:
            norm = grad_norm(self._params, tp_group=self.ctx.tp_group)
        bad = torch.maximum(bad, (~torch.isfinite(norm)).float())
        skip = comm.all_reduce_(bad, mesh_group(self.ctx), op=dist.ReduceOp.MAX)  # the one vote
        lr = self._set_lrs()
        for opt in self._optimizers():
            opt.found_inf, opt.grad_scale = skip, None  # fused AdamW: no update if 1
            opt.step()
        self._keep_masks()
        self._applied += (skip == 0).long()
        if self.scaler is not None:
            self.scaler.update(skip)
        report = self._report(loss_sum, n, weights, seen)
        return StepResult(report.pop("loss"), norm, skip > 0, lr, loss_scale, **report)

    def _set_lrs(self) -> torch.Tensor:
        """Each group's LR for this step, computed on the device from the applied-step counter;
        returns the first group's in float64 (the schedule's own precision, for reporting)."""
        self._take_loaded_schedule()
        factor = self.scheduler.lr_lambdas[0].on_device(self._applied)
        lrs = [base * factor for base in self.scheduler.base_lrs]
        for group, lr in zip(self._groups(), self._aligned(lrs)):
            group["lr"] = lr.float()  # fused AdamW's kernels read an fp32 LR tensor (as they round a float LR)
        return lrs[0]

    def _groups(self) -> list[dict]:
        return [group for opt in self._optimizers() for group in opt.param_groups]

    def _aligned(self, lrs: list) -> list:
        """The scheduler's LR of each group of `_groups` (its own optimizer's groups come first;
        every group has the same base LR, ``optim.lr``, so any further group takes the first's)."""
        return lrs + [lrs[0]] * (len(self._groups()) - len(lrs))

    def _take_loaded_schedule(self) -> None:
        if self.scheduler.last_epoch != self._host_epoch:  # a checkpoint was loaded into it
            self._applied.fill_(self.scheduler.last_epoch)
            self._host_epoch = self.scheduler.last_epoch

    def _sync_schedule(self) -> None:
        """Bring ``scheduler`` and the param groups' LRs (plain floats) up to the device counter
        (or the counter up to a scheduler state loaded since the last step)."""
        self._take_loaded_schedule()
        applied = int(self._applied.item())
        self.scheduler.last_epoch = self._host_epoch = applied
        lrs = [base * self.scheduler.lr_lambdas[0](applied) for base in self.scheduler.base_lrs]
        for group, lr in zip(self._groups(), self._aligned(lrs)):
            group["lr"] = lr
        self.scheduler._last_lr = lrs

    def checkpoint_state(self) -> dict:
        self._sync_schedule()
        return super().checkpoint_state()

    @property
    def lr(self) -> float:
        self._sync_schedule()
        return super().lr
