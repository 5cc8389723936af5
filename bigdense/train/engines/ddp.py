"""`DDPEngine`: torch DistributedDataParallel over the DP group, AdamW, bigdense's precision and clipping."""
from __future__ import annotations

import contextlib
import inspect

import torch

from ...validation import check_positive
from ..clip import clip_grad_norm_
from ..precision import Precision, any_rank
from ..schedule import build_lr_schedule
from .base import Engine, EngineSettings, StepResult, mesh_group, param_groups


def _no_buffer_sync(ddp_cls) -> dict:
    """DDP's keyword for "do not broadcast buffers before each forward": torch 2.13 renamed the
    switch (``forward_sync_buffers``); older releases only know ``broadcast_buffers``."""
    if "forward_sync_buffers" in inspect.signature(ddp_cls).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DDPEngine(Engine):
    """torch ``DistributedDataParallel`` over ``ctx.dp_group`` + AdamW (fp32) + autocast.

    Data parallelism: DDP over the DP group only (never the world, which would average across TP
    shards), and only when ``dp_size > 1``; all micro-batches but the last run under ``no_sync()``,
    so gradients are all-reduced once per step. Then, in order: fp16 unscale (one world all-reduce
    of the found-inf flag), `clip_grad_norm_` with ``optim.grad_clip`` (one TP all-reduce), one world
    all-reduce agreeing on skipping, the AdamW step and the LR schedule (only when not skipped), the
    loss-scale update, and one DP all-reduce of the loss for reporting. Parameters stay fp32 and the
    forward runs under autocast.
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
        if ctx.dp_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers (masks, tables) are built alike on every rank: no broadcast before each forward.
            self.wrapped = DistributedDataParallel(
                model,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.dp_group,
                bucket_cap_mb=float(settings.engine.bucket_cap_mb),
                gradient_as_bucket_view=True,
                **_no_buffer_sync(DistributedDataParallel),
            )
        else:
            self.wrapped = model
        self.optimizer = torch.optim.AdamW(
            param_groups(model, optim_cfg.weight_decay), lr=float(optim_cfg.lr),
            betas=tuple(float(b) for b in optim_cfg.betas), eps=float(optim_cfg.eps),
        )
        self.scheduler = build_lr_schedule(self.optimizer, optim_cfg, settings.max_steps)
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
