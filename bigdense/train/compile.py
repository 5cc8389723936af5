"""``trainer.compile``: torch.compile of each transformer block, or of the whole model.

* ``blocks``: each block's ``forward`` is replaced by its compiled version (`compile_blocks`);
  apply it before activation checkpointing, which then wraps the compiled forward. One graph per
  block, called once per block and step from Python.
* ``model``: the model's ``forward`` (embedding, blocks, final norm, the head and its fused loss)
  is replaced by one compiled function (`compile_model`); apply it *after* activation
  checkpointing, which Dynamo then traces into the graph (the recompute becomes the backward
  graph's own, its random keys saved by the forward). One forward graph and one backward graph a
  step, where Dynamo has no reason to break; the graphs a step compiled and the breaks it took
  are counted by `bigdense.train.compile_counts.GraphCounts` (`python -m bigdense.bench.step
  --compile model`).
* ``false`` (or ``none``): eager.

In both compiled modes the eager forward runs while host checks are on (a training run's first
``trainer.checked_steps``), so the graphs hold only the checks-off forward (`_unless_checked`).
In every case the module stays where it is, so parameter names, state dicts and checkpoints do not
change. Inside a graph the TP collectives are functional collectives (`bigdense.parallel.comm`) and
dropout keys are traced tensor draws. With inductor, random ops fall back to eager's generator
(``fallback_random``) so a compiled run draws the same dropout keys as an eager one; the masks
derived from a key are integer hashes, which inductor fuses into the multiply that applies them.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import ConfigError, check_choice
from ..host_checks import checks_enabled
from .compile_counts import GraphCounts, backend_for  # noqa: F401 - GraphCounts: re-exported

BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("false", "blocks", "model")  # trainer.compile
_SPELLINGS = {False: "false", None: "false", "none": "false", "off": "false", "False": "false",
              True: "blocks", "true": "blocks", "True": "blocks", "on": "blocks"}


def compile_mode(value: Any) -> str:
    """``trainer.compile`` as one of `MODES`: ``false``/``none`` off, ``true`` (the key's former
    boolean) is ``blocks``, ``blocks``, ``model``. Raises `ConfigError` naming the key."""
    key = value if isinstance(value, (bool, type(None))) else str(value).strip()
    mode = _SPELLINGS.get(key, key)
    return check_choice("trainer.compile", mode, MODES)


def check_compile(backend: str, mode: Any = "false") -> None:
    """``trainer.compile`` and ``trainer.compile_backend``'s rules (asked by `bigdense.config.validate`)."""
    compile_mode(mode)
    check_choice("trainer.compile_backend", backend, BACKENDS)


def _prepare(backend: str, graphs: int) -> None:
    check_choice("trainer.compile_backend", backend, BACKENDS, error=ValueError)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    # Identical blocks share one graph (parameters are graph inputs); should guards still tell
    # them apart, each may cost a compilation, but none may silently fall back to eager.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 2 * graphs + 8))


def _unless_checked(eager, backend: str, fullgraph: bool = False):
    """``eager`` compiled with ``backend``, but run eagerly while host checks are on (`bd.set_checks`).

    The checks read the device on the host (label and id ranges, the sequence shares' exchange),
    which Dynamo can only take as graph breaks: compiled, the checked steps would be a second,
    broken-up variant of the forward -- dozens of graphs and break warnings, a compile as slow as
    the real one -- and, since Dynamo re-traces only the frame whose guard changed, the checks-off
    steps after them would keep the broken-up pieces (``compile=blocks``: 12 graph calls a step
    against 2). So the graphs hold only the checks-off forward, compiled at its first call: the
    first step after the checked ones in a training run. A step's recompute runs under the same
    switch as its forward (both inside one step), so both take the same path."""
    compiled = torch.compile(eager, backend=backend_for(backend), fullgraph=fullgraph)

    def forward(*args, **kwargs):
        return (eager if checks_enabled() else compiled)(*args, **kwargs)

    return functools.wraps(eager)(forward)


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Compile every module of ``blocks`` (a ``ModuleList``) in place with ``backend``; eager while
    host checks are on (`_unless_checked`)."""
    blocks = list(blocks)
    _prepare(backend, len(blocks))
    for block in blocks:
        block.forward = _unless_checked(block.forward, backend)


def compile_model(model: nn.Module, backend: str = "inductor", *, fullgraph: bool = False) -> nn.Module:
    """Compile ``model.forward`` in place as one function with ``backend`` (``trainer.compile=model``);
    returns ``model``. ``fullgraph=True`` makes a graph break an error (the tests' setting); a
    training run takes a break, slower, rather than stopping, and `GraphCounts` reports it. Eager
    while host checks are on (`_unless_checked`)."""
    _prepare(backend, 2)
    model.forward = _unless_checked(model.forward, backend, fullgraph)
    return model


def apply_compile(model: nn.Module, mode: Any, backend: str, *, stage: str) -> None:
    """`parallelize_model`'s call, made twice: ``stage="before_recompute"`` compiles the blocks
    (``blocks``: checkpointing then wraps each compiled block), ``stage="after_recompute"`` the
    whole model (``model``: the graph then holds the checkpointed blocks)."""
    mode = compile_mode(mode)
    blocks = getattr(model, "blocks", None)
    if mode == "blocks" and stage == "before_recompute":
        if blocks is None:
            raise ConfigError(f"trainer.compile=blocks compiles a model's transformer blocks (its `blocks`); "
                              f"{type(model).__name__} has none: use trainer.compile=model")
        compile_blocks(blocks, backend)
    elif mode == "model" and stage == "after_recompute":
        compile_model(model, backend)
