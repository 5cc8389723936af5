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

In every case the module stays where it is, so parameter names, state dicts and checkpoints do not
change. Inside a graph the TP collectives are functional collectives (`bigdense.parallel.comm`) and
dropout keys are traced tensor draws. With inductor, random ops fall back to eager's generator
(``fallback_random``) so a compiled run draws the same dropout keys as an eager one; the masks
derived from a key are integer hashes, which inductor fuses into the multiply that applies them.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import ConfigError, check_choice
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


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Compile every module of ``blocks`` (a ``ModuleList``) in place with ``backend``."""
    blocks = list(blocks)
    _prepare(backend, len(blocks))
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend_for(backend))


def compile_model(model: nn.Module, backend: str = "inductor", *, fullgraph: bool = False) -> nn.Module:
    """Compile ``model.forward`` in place as one function with ``backend`` (``trainer.compile=model``);
    returns ``model``. ``fullgraph=True`` makes a graph break an error (the tests' setting); a
    training run takes a break, slower, rather than stopping, and `GraphCounts` reports it."""
    _prepare(backend, 2)
    model.forward = torch.compile(model.forward, backend=backend_for(backend), fullgraph=fullgraph)
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
