"""Reference models made only of bigdense layers."""
from .classifier import ParallelClassifier
from .gpt import GPT, Block, GPTConfig, ParallelSelfAttention

__all__ = ["GPT", "GPTConfig", "Block", "ParallelSelfAttention", "ParallelClassifier"]
