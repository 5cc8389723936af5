"""A many-class classifier: a small residual MLP backbone and a huge fully connected head.

Per TP rank: input features (B, in_features) replicated; ``stem`` an ordinary nn.Linear
(replicated, it is small); ``blocks`` ParallelMLPs (hidden units split over TP); ``head`` a
ParallelClassifierHead whose classes are split over TP and whose loss never gathers the logits.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..layers import ParallelClassifierHead, ParallelMLP
from ..parallel.context import resolve_tp_group


class ParallelClassifier(nn.Module):
    """``head(ln(blocks(stem(x))))``; ``forward(x, target)`` is the mean cross-entropy."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        d_model: int = 256,
        n_blocks: int = 2,
        dropout: float = 0.0,
        head_chunk_size: Optional[int] = None,
        tp_group=None,
    ):
        super().__init__()
        tp_group = resolve_tp_group(tp_group)
        self.stem = nn.Linear(in_features, d_model)
        self.blocks = nn.ModuleList(
            ParallelMLP(d_model, 4 * d_model, "gelu", dropout=dropout, tp_group=tp_group) for _ in range(n_blocks)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = ParallelClassifierHead(d_model, num_classes, chunk_size=head_chunk_size, tp_group=tp_group)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h))
        return self.ln_f(h)

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.features(x), target)

    def predict(self, x: torch.Tensor, k: int = 1):
        """Global top-k (scores, class ids), each (B, k), without gathering the logits."""
        return self.head.predict(self.features(x), k)
