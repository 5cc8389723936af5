"""How a bad value is reported: `ConfigError` and the few checks every owner of a rule shares.

The *rules* (which values an option allows, which ranges a number must lie in) live next to the
code they govern -- `layers.mlp.ACTIVATIONS`, `train.recompute.MODES`, `ParallelDims`, ... --
and `bigdense.config.validate` asks those owners. This module only words the errors, once.
"""
from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A configuration value a person has to change; the message names the key."""


def check_choice(key: str, value: Any, allowed: Iterable, error: type = ConfigError) -> Any:
    """``value`` if it is one of ``allowed``; else ``error("<key>=<value> is not one of [...]")``."""
    allowed = list(allowed)
    if value not in allowed:
        raise error(f"{key}={value!r} is not one of {allowed}")
    return value


def is_positive_int(value: Any) -> bool:
    """A Python int >= 1 (``True`` is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(what: str, value: Any, error: type = ValueError) -> int:
    """``value`` if `is_positive_int`; else ``error("<what> must be a positive integer, got ...")``."""
    if not is_positive_int(value):
        raise error(f"{what} must be a positive integer, got {value!r}")
    return value


def check_positive(key: str, value: Any, allow_zero: bool = False, error: type = ConfigError) -> Any:
    """A number > 0 (>= 0 with ``allow_zero``); else ``error("<key> must be > 0, got ...")``."""
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise error(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value
