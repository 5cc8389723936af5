"""The switch for input checks that need the host to look at device data.

Range checks of ids and class labels read the tensor's values (a device-to-host copy, which stalls
a GPU stream). They are on by default, in tests and for the first steps of a training run; the
training job turns them off in its hot loop. Shape, dtype and device checks cost nothing and stay
on always. Three ways to set it, the innermost winning:

    bd.set_checks(False)                 # process-wide
    with bd.set_checks(False): ...       # for a block, restored on exit
    BIGDENSE_CHECKS=0 python ...         # the initial value (1 when unset)

With checks off, an id or label out of range is not caught on the host; what the layers do then
is documented on each (`VocabParallelEmbedding`, `ParallelClassifierHead.loss`).
"""
from __future__ import annotations

import os

_ENV = "BIGDENSE_CHECKS"


def env_flag(name: str, default: bool) -> bool:
    """A 0/1 switch from the environment (also true/false, yes/no, on/off; unset or empty: ``default``)."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"bigdense: {name} must be 0 or 1, got {value!r}")


_enabled: bool = env_flag(_ENV, True)


def checks_enabled() -> bool:
    """Whether host-side range checks run now."""
    return _enabled


class set_checks:
    """Turn host-side range checks on or off; usable as a call or as a context manager.

    Called plainly it sets the process-wide value and returns an object whose ``__exit__`` (when
    used in ``with``) restores the value seen before the call.
    """

    def __init__(self, enabled: bool):
        global _enabled
        if not isinstance(enabled, bool):
            raise TypeError(f"bd.set_checks: expected True or False, got {enabled!r}")
        self._previous = _enabled
        _enabled = enabled

    def __enter__(self) -> "set_checks":
        return self

    def __exit__(self, *exc) -> None:
        global _enabled
        _enabled = self._previous
