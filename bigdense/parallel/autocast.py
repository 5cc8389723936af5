"""Autocast's state on any device, also the meta device (shape-only runs: op counting, planning),
which has none and on which torch's autocast queries raise."""
from __future__ import annotations

import contextlib

import torch


def autocast_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype autocast computes in on ``device_type`` when it is on there, else ``default``."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return default
    return torch.get_autocast_dtype(device_type)


def no_autocast(device_type: str):
    """A context with autocast off on ``device_type`` (nothing to turn off on the meta device)."""
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)
