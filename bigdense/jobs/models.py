"""The jobs' models, built from the run's config: every option reaches the model through its
config object (`GPTConfig.from_config` reads the ``model`` and ``parallel`` groups), never by
changing a built model. Built on the mesh's device, sharded over its TP group from the start."""
from __future__ import annotations

import torch

from ..models import GPT, GPTConfig, TextClassifier
from ..parallel.context import ParallelContext


def gpt_config(cfg, vocab_size: int) -> GPTConfig:
    """The reference GPT's `GPTConfig` of a run config (``model`` and ``parallel`` groups)."""
    return GPTConfig.from_config(cfg.model, vocab_size, cfg.parallel)


def build_gpt(cfg, vocab_size: int, ctx: ParallelContext) -> GPT:
    """The reference GPT of a run config, sharded over ``ctx``'s TP group."""
    with torch.device(ctx.device):
        return GPT(gpt_config(cfg, vocab_size), tp_group=ctx.tp_group)


def build_text_classifier(cfg, vocab_size: int, num_classes: int, ctx: ParallelContext) -> TextClassifier:
    """`launch/classify.py`'s model: the reference transformer, pooled, and the ``head`` group's
    `ParallelClassifierHead` (classes over TP, or over every rank)."""
    head = cfg.head
    margin = head.margin if head.margin is None or isinstance(head.margin, str) else tuple(head.margin)
    with torch.device(ctx.device):
        return TextClassifier(gpt_config(cfg, vocab_size), num_classes, tp_group=ctx.tp_group,
                              dp_group=ctx.dp_group, shard=head.shard, sample_rate=head.sample_rate, margin=margin,
                              scale=head.scale)
