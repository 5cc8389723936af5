"""What fused losses count besides the loss, collected on the device without a host read; and the
factor a caller will scale a loss by, told to the losses that need it in advance.

Every call of the fused cross-entropy (`fused_ce.fused_cross_entropy`: a `ParallelClassifierHead`'s
``loss``, a Hugging Face model's loss through `bigdense.models.CausalLM`) hands its counts to the
innermost open collector, if any:

    with bd.collect_loss_metrics() as seen:
        loss = model(x, y)
    seen.tokens, seen.correct, seen.z_loss    # device scalars, summed over the calls

``tokens``: the tokens the losses counted (targets not ignored); ``correct``: of them, those whose
target's logit is the largest (a tie for the largest counts as right, where ``argmax`` picks the
lowest class id; with a margin, of the margin's logits; with sampling, of the scored classes); ``z_loss``: the sum of their z-loss terms (``z_loss * lse**2``, 0 without
one). The engines open one around each step's forwards and report accuracy and the mean z-loss
(`bigdense.train.engines.base.StepResult`). Recording is a list append, which ``torch.compile``
replays after its graph: a compiled model records as an eager one does.

`loss_factor`: the engines weight each micro-batch's loss by its share of the step's counted tokens
(`bigdense.train.engines.base.TokenWeights`), a factor that differs between DP ranks. A head whose
weight gradient sums every DP rank's tokens, formed in its forward (a world-sharded head), must know
every rank's factor then; the engine says its own around each forward, and such a head gathers
them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

METRICS = ("tokens", "correct", "z_loss")  # what each call records, in order
_OPEN: list["LossMetrics"] = []
_FACTORS: list[torch.Tensor] = []


class LossMetrics:
    """The sums of the fused losses run while it was the innermost open collector."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []  # each call's (tokens, correct, z_loss), (3,) fp32

    def add(self, metrics: torch.Tensor) -> None:
        self.parts.append(metrics)

    @property
    def totals(self) -> Optional[torch.Tensor]:
        """(tokens, correct, z_loss) summed over the calls, (3,) fp32 on the device; None if none ran."""
        return torch.stack(self.parts).sum(dim=0) if self.parts else None

    def _total(self, name: str) -> Optional[torch.Tensor]:
        return None if not self.parts else self.totals[METRICS.index(name)]

    tokens = property(lambda self: self._total("tokens"))
    correct = property(lambda self: self._total("correct"))
    z_loss = property(lambda self: self._total("z_loss"))


@contextlib.contextmanager
def collect_loss_metrics() -> Iterator[LossMetrics]:
    """Collect the counts of every fused loss run inside the block (see the module docstring)."""
    seen = LossMetrics()
    _OPEN.append(seen)
    try:
        yield seen
    finally:
        _OPEN.remove(seen)


def record(metrics: torch.Tensor) -> None:
    """Give one call's (tokens, correct, z_loss) to the innermost open collector (none: dropped)."""
    if _OPEN:
        _OPEN[-1].add(metrics)


@contextlib.contextmanager
def loss_factor(factor: torch.Tensor) -> Iterator[None]:
    """Inside the block, the caller will multiply the losses it gets by ``factor`` (a device scalar)
    before backpropagating them (see the module docstring)."""
    _FACTORS.append(factor)
    try:
        yield
    finally:
        _FACTORS.pop()


def current_loss_factor() -> Optional[torch.Tensor]:
    """The innermost `loss_factor`'s, or None (1)."""
    return _FACTORS[-1] if _FACTORS else None
