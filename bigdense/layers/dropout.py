"""`ShardedDropout`: dropout on TP-sharded features that draws this rank's slice of the unsharded mask."""
from __future__ import annotations

import torch.nn as nn

from ..parallel.dropout import tp_dropout
from .base import DenseTwin


class ShardedDropout(DenseTwin, nn.Module):
    """Dropout on TP-sharded features (*, hidden_local): this rank's slice of the mask the unsharded
    layer would draw (`tp_dropout`), so the masks of different ranks are not copies of each other.

    Its plain twin (`DenseTwin`) is an ``nn.Dropout(p)``, which holds no tensor and draws its own
    masks: ``from_dense(dropout, global_size=..., offset=...)`` takes ``p`` from it, the features
    from the caller; ``to_dense`` is no collective; ``load_dense_`` has nothing to copy."""

    _dense_kind = nn.Dropout

    def __init__(self, p: float, global_size: int, offset: int):
        super().__init__()
        self.p, self.global_size, self.offset = p, global_size, offset

    def forward(self, x):
        return tp_dropout(x, self.p, self.training, shard_dim=-1, global_size=self.global_size, offset=self.offset)

    def extra_repr(self) -> str:
        return f"p={self.p}, offset={self.offset}, global_size={self.global_size}"

    def _dense_twin(self) -> nn.Dropout:
        return nn.Dropout(self.p)

    @classmethod
    def _empty_from_dense(cls, dropout: nn.Dropout, *, global_size: int, offset: int) -> "ShardedDropout":
        return cls(dropout.p, global_size, offset)
