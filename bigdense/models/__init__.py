"""Reference models made only of bigdense layers, and `CausalLM`, which lets the engines train a
Hugging Face causal LM."""
from .classifier import ParallelClassifier, TextClassifier
from .gpt import GPT, Block, GPTConfig, ParallelSelfAttention
from .hf import CausalLM

# model.name values: "gpt" is built by launch/train.py (bigdense.jobs.build_gpt), "encoder"
# (the GPT's trunk, pooled, and a big head: TextClassifier) by launch/classify.py, "hf" (a Hugging
# Face causal LM from a save_pretrained directory, in a CausalLM) by launch/train.py (bigdense.jobs.build_hf)
MODELS = ("gpt", "encoder", "hf")

__all__ = ["MODELS", "GPT", "GPTConfig", "Block", "ParallelSelfAttention", "ParallelClassifier", "TextClassifier",
           "CausalLM"]
