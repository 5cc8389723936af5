"""Gradual pruning during training (the ``prune`` config group of ``launch/train.py``), as
``torch.ao.pruning``'s schedulers do: the named layers are pruned to a rising sparsity every
``every`` steps, ``steps`` times, on Zhu and Gupta's cubic schedule (fast while many weights are
left, slow near the end):

    event i = 0 .. steps-1, once start_step + i * every steps are done:
        sparsity_i = sparsity * (1 - (1 - (i + 1) / steps) ** 3)

Each event is one `bd.prune` call; the pruned entries go first at the next, so the masks only grow.
``structure="n:m"`` has one sparsity (1 - n/m), so one event (``steps=1``). ``"rows"`` changes the
layers' shapes under the optimizer, so it is not a training option (`bd.prune` it, then train).

The masks are attached (all True) when the pruner is built, after any ``trainer.init_from`` load and
before a resume, so a resumed run's checkpoint holds them and restores them. Held through
training by the DDP engine (`bigdense.layers.prune_masks`): ``engine=ddp`` only.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from ..errors import ConfigError, check_choice, check_positive, check_positive_int
from .pruning import PruneReport, attach_masks, check_n_m_layout, check_sparsity, dense_layers, prune, weight_spec

log = logging.getLogger("bigdense")

GRADUAL_STRUCTURES = ("unstructured", "n:m")
ENGINES = ("ddp",)  # the engines that re-apply masks after their optimizer step


def enabled(cfg) -> bool:
    return float(cfg.sparsity) > 0


def check_prune_schedule(cfg, engine_kind: str) -> None:
    """The ``prune.*`` keys' rules (`ConfigError` naming the key)."""
    if not enabled(cfg):
        return
    check_choice("prune.structure", str(cfg.structure), GRADUAL_STRUCTURES)
    try:
        check_sparsity(float(cfg.sparsity), str(cfg.structure), int(cfg.n), int(cfg.m))
    except ValueError as err:
        raise ConfigError(f"prune.sparsity={cfg.sparsity}: {err}") from None
    check_positive("prune.start_step", cfg.start_step, allow_zero=True)
    check_positive_int("prune.every", cfg.every, ConfigError)
    check_positive_int("prune.steps", cfg.steps, ConfigError)
    if cfg.structure == "n:m" and cfg.steps != 1:
        raise ConfigError(f"prune.steps={cfg.steps}: prune.structure=n:m has one sparsity (1 - n/m), so one event; "
                          f"set prune.steps=1")
    if engine_kind not in ENGINES:
        raise ConfigError(f"prune.sparsity={cfg.sparsity} (pruning during training) needs engine=ddp, which keeps the "
                          f"pruned weights at zero after each optimizer step; got engine={engine_kind}")


def sparsity_at(cfg, done: int) -> Optional[float]:
    """The sparsity to prune to once ``done`` steps are done; None when that is no event."""
    offset = done - int(cfg.start_step)
    if not enabled(cfg) or offset < 0 or offset % int(cfg.every) or offset // int(cfg.every) >= int(cfg.steps):
        return None
    i, steps = offset // int(cfg.every), int(cfg.steps)
    return float(cfg.sparsity) * (1 - (1 - (i + 1) / steps) ** 3)


class GradualPruning:
    """``pruner.before_step(n)`` before training step ``n`` (1-based) prunes when ``n - 1`` steps
    done is an event of the schedule; returns its `PruneReport` (None otherwise)."""

    def __init__(self, model: nn.Module, cfg):
        self.model, self.cfg = model, cfg
        self.layers, self.patterns = None, None
        if not enabled(cfg):
            return
        layers = [cfg.layers] if isinstance(cfg.layers, str) else cfg.layers
        self.patterns = None if layers is None else [str(p) for p in layers]
        try:
            if cfg.structure == "n:m":  # a split that cuts groups stops the run now, not at the event
                for name, layer in dense_layers(model, self.patterns):
                    check_n_m_layout(name, layer, weight_spec(layer), int(cfg.m))
            self.layers = attach_masks(model, self.patterns)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"prune.layers={cfg.layers}: {err}") from None

    def before_step(self, step: int) -> Optional[PruneReport]:
        sparsity = None if self.layers is None else sparsity_at(self.cfg, step - 1)
        if sparsity is None:
            return None
        structure = str(self.cfg.structure)
        report = prune(self.model, None if structure == "n:m" else sparsity, structure, layers=self.patterns,
                       n=int(self.cfg.n), m=int(self.cfg.m))
        log.info("before step %d: %s", step, report)
        return report
