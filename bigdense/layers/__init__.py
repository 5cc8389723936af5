"""Tensor-parallel layers and their initialisers."""
from .base import TensorParallelModule, materialize
from .conv1d import ColumnParallelConv1D, RowParallelConv1D
from .dropout import ShardedDropout
from .embedding import VocabParallelEmbedding
from .feature_norm import ShardedBatchNorm1d
from .head import ParallelClassifierHead
from .tying import tie_weights
from .init import INITIALIZERS, Initializer
from .linear import ColumnParallelLinear, RowParallelLinear
from .lowrank import low_rank, low_rank_like
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm
from .pruning import PruneReport, attach_masks, prune
from .prune_masks import apply_masks
from .quant import Int8Linear, quantize_int8
from .sparse import SparseLinear, SparseReport, to_sparse

__all__ = [
    "TensorParallelModule", "materialize", "Initializer", "INITIALIZERS", "ColumnParallelLinear", "RowParallelLinear",
    "ColumnParallelConv1D", "RowParallelConv1D",
    "ParallelMLP", "VocabParallelEmbedding", "ParallelClassifierHead", "tie_weights", "ShardedDropout", "low_rank",
    "low_rank_like", "LayerNorm", "RMSNorm", "ShardedBatchNorm1d", "prune", "PruneReport", "attach_masks",
    "apply_masks", "Int8Linear", "quantize_int8", "SparseLinear", "SparseReport", "to_sparse",
]
