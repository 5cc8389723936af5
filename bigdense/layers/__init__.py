"""Tensor-parallel layers and their initialisers."""
from .base import TensorParallelModule, materialize
from .conv1d import ColumnParallelConv1D, RowParallelConv1D
from .dropout import ShardedDropout
from .embedding import VocabParallelEmbedding
from .feature_norm import ShardedBatchNorm1d
from .head import LossMetrics, ParallelClassifierHead, collect_loss_metrics, fused_cross_entropy
from .tying import tie_weights
from .init import INITIALIZERS, Initializer
from .linear import ColumnParallelLinear, RowParallelLinear
from .lora import add_lora, merge_lora_
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm

__all__ = [
    "TensorParallelModule", "materialize", "Initializer", "INITIALIZERS", "ColumnParallelLinear", "RowParallelLinear",
    "ColumnParallelConv1D", "RowParallelConv1D",
    "ParallelMLP", "VocabParallelEmbedding", "ParallelClassifierHead", "fused_cross_entropy", "collect_loss_metrics",
    "LossMetrics", "tie_weights", "ShardedDropout",
    "LayerNorm", "RMSNorm", "ShardedBatchNorm1d", "add_lora", "merge_lora_",
]
