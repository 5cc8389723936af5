"""Activation checkpointing from ``RecomputeConfig``: keep a block's inputs, recompute its inside.

A checkpointed module's forward runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` with ``preserve_rng_state`` on: the CPU generator and the device's are
restored before the recompute, so `tp_dropout`, which draws its keys from torch's default
generator of the activation's device, redraws exactly the masks of the first forward; the forward's `batch_slice` (the
engines' DP row offset) is re-entered around the recompute too. Gradients with and without
checkpointing are therefore bit-identical. The collectives inside the module (TP all-reduces) run
again in the recompute, on every TP rank alike.

Modules are patched in place (their ``forward`` is wrapped), not wrapped in a new module, so
parameter names, state dicts and checkpoints are the same with and without recompute.
"""
from __future__ import annotations

import contextlib
import types
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..parallel.dropout import batch_slice, current_batch_slice
from ..errors import ConfigError, check_choice, check_positive_int

MODES = ("none", "full", "mlp", "every_k")
MLP_ATTR = "mlp"  # how a block exposes its MLP sub-module for mode=mlp


def _recompute_contexts():
    # The recompute runs during backward, outside the engine's `batch_slice`; without it dropout
    # would draw the rows of another batch. Re-enter the forward's slice around the recompute.
    # (A backward run *inside* some other batch_slice cannot be cleared to "none" here; engines
    # never do that.)
    current = current_batch_slice()
    return contextlib.nullcontext(), (batch_slice(*current) if current is not None else contextlib.nullcontext())


def _checkpointed_forward(self, *args, **kwargs):
    inner = self._bd_inner_forward
    if not torch.is_grad_enabled():
        # Evaluation: there is no backward to recompute for.
        return inner(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Traced (trainer.compile=model): the forward's batch slice is baked into the ops the
        # recompute replays, and its dropout keys are saved by the forward; nothing to re-enter.
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=_recompute_contexts, **kwargs)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward run under activation checkpointing (idempotent). Returns it."""
    if not is_checkpointed(module):
        module._bd_inner_forward = module.forward
        module.forward = types.MethodType(_checkpointed_forward, module)
    return module


def uncheckpoint_module(module: nn.Module) -> nn.Module:
    """Undo `checkpoint_module`."""
    if is_checkpointed(module):
        del module.forward  # the instance attribute; the class's forward shows through again
        del module._bd_inner_forward
    return module


def is_checkpointed(module: nn.Module) -> bool:
    return "_bd_inner_forward" in module.__dict__


def check_recompute(mode: str, every: int = 2) -> None:
    """The ``recompute`` group's rules: ``mode`` is one of `MODES`; for ``every_k``, ``every`` (k) is a
    positive integer."""
    check_choice("recompute.mode", mode, MODES)
    if mode == "every_k":
        check_positive_int("recompute.every", every, ConfigError)


def recompute_targets(blocks: Sequence[nn.Module], mode: str, every: int = 2) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` pairs a mode checkpoints; names are relative to ``blocks`` (``"3"``, ``"3.mlp"``).

    ``full``: every block. ``mlp``: each block's ``mlp`` attribute (the attention, whose
    activations are smaller per FLOP, is kept). ``every_k``: blocks 0, k, 2k, ... (``every`` = k).
    """
    check_recompute(mode, every)
    if mode == "none":
        return []
    if mode == "full":
        return [(str(i), b) for i, b in enumerate(blocks)]
    if mode == "every_k":
        return [(str(i), b) for i, b in enumerate(blocks) if i % every == 0]
    out = []
    for i, block in enumerate(blocks):
        mlp = getattr(block, MLP_ATTR, None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(
                f"recompute.mode=mlp: block {i} ({type(block).__name__}) must expose its MLP as the "
                f"sub-module attribute `{MLP_ATTR}`, got {type(mlp).__name__}"
            )
        out.append((f"{i}.{MLP_ATTR}", mlp))
    return out


def apply_recompute(blocks: Sequence[nn.Module], cfg) -> list[str]:
    """Checkpoint the blocks (or their MLPs) that ``cfg`` selects; return their names.

    ``blocks`` is the model's sequence of transformer blocks (an ``nn.ModuleList``); ``cfg`` a
    ``RecomputeConfig`` (or anything with ``mode`` and ``every``). Apply it once, after building
    the model and before wrapping it in DDP/DeepSpeed; a second call with another mode first
    undoes the previous one.
    """
    for block in blocks:
        for sub in block.modules():
            uncheckpoint_module(sub)
    targets = recompute_targets(blocks, str(cfg.mode), int(getattr(cfg, "every", 2)))
    for _, module in targets:
        checkpoint_module(module)
    return [name for name, _ in targets]
