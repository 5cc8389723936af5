"""Reference models made only of bigdense layers."""
from .classifier import ParallelClassifier
from .gpt import GPT, Block, GPTConfig, ParallelSelfAttention

MODELS = ("gpt",)  # model.name values launch/train.py builds (bigdense.train.run_setup.build_gpt)

__all__ = ["MODELS", "GPT", "GPTConfig", "Block", "ParallelSelfAttention", "ParallelClassifier"]
