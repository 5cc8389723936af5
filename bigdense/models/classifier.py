"""Many-class classifiers: a small residual MLP backbone or the reference transformer with pooling,
and a huge fully connected head.

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
from .gpt import GPT, add_trunk, trunk_edges


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

    def edges(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The stem, and the final norm with the head (units of `bigdense.train.engines.fsdp.apply_fsdp`)."""
        return [self.stem], [self.ln_f, self.head]

    def predict(self, x: torch.Tensor, k: int = 1):
        """Global top-k (scores, class ids), each (B, k), without gathering the logits."""
        return self.head.predict(self.features(x), k)


class TextClassifier(nn.Module):
    """The reference transformer (the GPT's blocks) with mean pooling and a big classifier head.

    ``forward(idx, target)``: ``idx`` (B, S) token ids, ``target`` (B,) class ids, both replicated
    over TP; returns the head's mean loss. ``predict(idx, k)``: global top-k (scores, class ids).
    ``head_options`` go to `ParallelClassifierHead` (``shard``, ``sample_rate``, ``margin``,
    ``scale``); a margin head has no bias.
    """

    def __init__(self, cfg, num_classes: int, *, tp_group=None, dp_group=None, **head_options):
        super().__init__()
        self.cfg = cfg
        if cfg.sequence_parallel:
            raise ValueError("TextClassifier: mean pooling needs the whole sequence on every TP rank; "
                             "sequence parallelism is not supported (parallel.sequence_parallel=false)")
        add_trunk(self, cfg, tp_group)
        tp_group = self.tp_group
        self.head = ParallelClassifierHead(
            cfg.d_model, num_classes, bias=head_options.get("margin") is None, chunk_size=cfg.head_chunk_size,
            init=cfg.init, tp_group=tp_group, dp_group=dp_group, **head_options,
        )

    # The GPT's trunk, read through the same attribute names: (B, S, d_model), replicated over TP.
    hidden = GPT.hidden

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """Mean over positions of the final normalised hidden states, (B, d_model)."""
        return self.hidden(idx).mean(dim=1)

    def forward(self, idx: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.features(idx), target)

    def edges(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The embeddings, and the final norm with the head (`trunk_edges`)."""
        return trunk_edges(self)

    def predict(self, idx: torch.Tensor, k: int = 1):
        return self.head.predict(self.features(idx), k)
