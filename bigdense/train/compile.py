"""``trainer.compile``: torch.compile each transformer block in place.

Each block's ``forward`` is replaced by its compiled version (the module stays where it is, so
parameter names, state dicts and checkpoints do not change); apply it before activation
checkpointing, which then wraps the compiled forward. Inside, the TP collectives are functional
collectives (`bigdense.parallel.comm`) and dropout keys are traced tensor draws, so a block is one
graph (tests compile one with ``fullgraph=True``). With inductor, random ops fall back to eager's
generator (``fallback_random``) so a compiled run draws the same dropout masks as an eager one.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from ..errors import check_choice

BACKENDS = ("inductor", "aot_eager", "eager")


def check_compile(backend: str) -> None:
    """``trainer.compile_backend``'s rule (asked by `bigdense.config.validate`)."""
    check_choice("trainer.compile_backend", backend, BACKENDS)


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Compile every module of ``blocks`` (a ``ModuleList``) in place with ``backend``."""
    check_choice("trainer.compile_backend", backend, BACKENDS, error=ValueError)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    blocks = list(blocks)
    # Identical blocks share one graph (parameters are graph inputs); should guards still tell
    # them apart, each may cost a compilation, but none may silently fall back to eager.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 2 * len(blocks) + 8))
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
