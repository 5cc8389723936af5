"""`build_engine`: the engine the config names, built from one `EngineSettings`."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ...parallel.context import ParallelContext, get_default_context
from ...errors import check_choice
from .base import Engine, EngineSettings
from .ddp import DDPEngine
from .deepspeed import DSEngine
from .fsdp import FSDPEngine

ENGINES = {"ddp": DDPEngine, "deepspeed": DSEngine, "fsdp": FSDPEngine}  # engine.kind -> class


def engine_class(kind: str) -> type[Engine]:
    """The class ``engine.kind`` names."""
    return ENGINES[check_choice("engine.kind", str(kind), ENGINES)]


def check_engine(settings: EngineSettings, device_type: str) -> None:
    """Every engine rule for these settings on ``device_type``, without building anything."""
    engine_class(settings.engine.kind).check_config(settings, device_type)


def build_engine(
    model: nn.Module,
    ctx: Optional[ParallelContext] = None,
    settings: Optional[EngineSettings] = None,
    *,
    engine_cfg=None,
    optim_cfg=None,
    precision_cfg=None,
    micro_batch_size: Optional[int] = None,
    grad_accum: int = 1,
    max_steps: Optional[int] = None,
) -> Engine:
    """The engine ``settings.engine.kind`` names, around ``model`` (already on ``ctx.device``).

    ``settings`` is an `EngineSettings` (``EngineSettings.from_run_config(cfg)``); the keywords
    build one instead (``engine_cfg=cfg.engine, optim_cfg=cfg.optim, precision_cfg=...,
    micro_batch_size=..., grad_accum=..., max_steps=...``). Build it after the model is complete
    (recompute applied, weights tied) and after seeding: the engine does not consume the RNG dropout
    draws from. ``ctx`` defaults to the default context.
    """
    ctx = ctx if ctx is not None else get_default_context()
    if settings is None:
        settings = EngineSettings(engine=engine_cfg, optim=optim_cfg, precision=precision_cfg,
                                  micro_batch_size=micro_batch_size, grad_accum=grad_accum, max_steps=max_steps)
    return engine_class(settings.engine.kind)(model, ctx, settings)
