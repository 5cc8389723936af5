"""Tensor-parallel layers and their initialisers."""
from .base import TensorParallelModule, materialize
from .init import INITIALIZERS, Initializer
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["TensorParallelModule", "materialize", "Initializer", "INITIALIZERS", "ColumnParallelLinear", "RowParallelLinear"]
