"""The learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` (or constant)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..errors import ConfigError, check_choice, check_positive


@dataclass
class WarmupCosine:
    """Multiplier of the base LR after ``step`` applied optimizer steps (a ``LambdaLR`` lambda).

    Warm-up: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, so the first update
    already moves (a zero LR would waste a step). Then ``schedule="cosine"`` falls from 1 to
    ``min_ratio`` (= min_lr / lr) at ``total_steps`` and stays there; ``"constant"`` stays at 1.
    A callable object rather than a closure, so ``LambdaLR.state_dict()`` records its settings.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float
    schedule: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def on_device(self, step: torch.Tensor) -> torch.Tensor:
        """The same multiplier for a step count held in a tensor (float64, on its device): lets an
        engine hold the schedule on skipped steps without reading the skip decision on the host."""
        step = step.double()
        warm = (step + 1) / max(1, self.warmup_steps)
        if self.schedule == "constant":
            after = torch.ones_like(step)
        else:
            span = max(1, self.total_steps - self.warmup_steps)
            progress = ((step - self.warmup_steps) / span).clamp(max=1.0)
            after = self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + torch.cos(math.pi * progress))
        return torch.where(step < self.warmup_steps, warm, after)


SCHEDULES = ("cosine", "constant")  # optim.schedule


def check_schedule(optim_cfg) -> None:
    """The schedule's rules: a known ``schedule``, ``lr > 0``, ``0 <= min_lr <= lr``, ``warmup_steps >= 0``."""
    check_choice("optim.schedule", str(optim_cfg.schedule), SCHEDULES)
    lr = float(check_positive("optim.lr", optim_cfg.lr))
    if not 0.0 <= float(optim_cfg.min_lr) <= lr:
        raise ConfigError(f"optim.min_lr must be in [0, optim.lr={lr}], got {optim_cfg.min_lr}")
    check_positive("optim.warmup_steps", optim_cfg.warmup_steps, allow_zero=True)


# The config key each setting of the schedule comes from, for the message of a changed schedule.
_SOURCE_KEYS = {"warmup_steps": "optim.warmup_steps", "total_steps": "trainer.max_steps",
                "min_ratio": "optim.min_lr / optim.lr", "schedule": "optim.schedule"}


def follow_config(scheduler: torch.optim.lr_scheduler.LambdaLR, optim_cfg, max_steps: int) -> list[str]:
    """Make a schedule just restored from a checkpoint follow the config again; return the changes.

    A checkpoint stores the schedule's settings, so a run resumed with a larger ``max_steps`` (an
    extension) would otherwise keep decaying to the old end and train its new steps at the floor
    learning rate. The settings and base LR are set from the config, the step count is kept, and
    the optimizer's LR is set for the next step. Returns ``["trainer.max_steps: 20 -> 40", ...]``.
    """
    fresh = build_lr_schedule(torch.optim.SGD([torch.zeros(1)], lr=float(optim_cfg.lr)), optim_cfg, max_steps)
    target = fresh.lr_lambdas[0]
    changes = []
    for lam in scheduler.lr_lambdas:
        for f in fields(WarmupCosine) if isinstance(lam, WarmupCosine) else ():
            old, new = getattr(lam, f.name), getattr(target, f.name)
            if old != new:
                changes.append(f"{_SOURCE_KEYS[f.name]}: {old:g} -> {new:g}" if f.name != "schedule"
                               else f"{_SOURCE_KEYS[f.name]}: {old} -> {new}")
                setattr(lam, f.name, new)
    lr = float(optim_cfg.lr)
    if any(base != lr for base in scheduler.base_lrs):
        changes.append(f"optim.lr: {scheduler.base_lrs[0]:g} -> {lr:g}")
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    changes = list(dict.fromkeys(changes))  # one line per setting, not per parameter group
    for group, base, lam in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * lam(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return changes


def build_lr_schedule(optimizer: torch.optim.Optimizer, optim_cfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` from ``OptimConfig`` (lr, min_lr, warmup_steps, schedule).

    Step it once per *applied* optimizer step: a skipped step (overflow, non-finite norm) does not
    advance the schedule, which is also what DeepSpeed does.
    """
    check_schedule(optim_cfg)
    lr, min_lr, warmup = float(optim_cfg.lr), float(optim_cfg.min_lr), int(optim_cfg.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, int(max_steps), min_lr / lr, str(optim_cfg.schedule)))
