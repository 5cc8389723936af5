"""The jobs' models, built from the run's config: every option reaches the model through its
config object (`GPTConfig.from_config` reads the ``model`` and ``parallel`` groups), never by
changing a built model. bigdense's models are built on the mesh's device, sharded over its TP
group from the start; a Hugging Face model (``model=hf``) is built on the meta device, to be
converted and filled with its weights by `bigdense.jobs.parallelize_model`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..data.tokenizer import TokenizerFile
from ..errors import ConfigError
from ..models import GPT, CausalLM, GPTConfig, TextClassifier
from ..models.hf_dir import HFDirectory
from ..parallel.context import ParallelContext


def gpt_config(cfg, vocab_size: int) -> GPTConfig:
    """The reference GPT's `GPTConfig` of a run config (``model`` and ``parallel`` groups)."""
    return GPTConfig.from_config(cfg.model, vocab_size, cfg.parallel)


def build_gpt(cfg, vocab_size: int, ctx: ParallelContext) -> GPT:
    """The reference GPT of a run config, sharded over ``ctx``'s TP group."""
    with torch.device(ctx.device):
        return GPT(gpt_config(cfg, vocab_size), tp_group=ctx.tp_group)


def model_tokenizer(cfg) -> Optional[TokenizerFile]:
    """The tokenizer that comes with the model (``model=hf`` with a tokenizer.json), else None:
    the data group trains one on the corpus."""
    return HFDirectory.open(cfg.model.path).tokenizer() if cfg.model.name == "hf" else None


def build_hf(cfg, keep_files_in: Optional[Path] = None) -> CausalLM:
    """The Hugging Face causal LM of ``model.path`` in a `CausalLM`, its parameters on the meta
    device (nothing allocated; rotary and other computed buffers are real): `parallelize_model`
    converts it by its own plan, allocates each rank's shards and reads them from the directory.
    ``keep_files_in`` (a run's ``hf/``, given on one rank): where the directory's config and
    tokenizer files are copied, for `bigdense.export_hf`."""
    source = HFDirectory.open(cfg.model.path)
    if keep_files_in is not None:
        source.keep_beside(keep_files_in)
    lm = source.meta_model()
    return CausalLM(lm, pretrained=str(source.path), z_loss=cfg.model.z_loss, fused_loss=cfg.model.fused_loss)


def build_text_classifier(cfg, vocab_size: int, num_classes: int, ctx: ParallelContext) -> TextClassifier:
    """`launch/classify.py`'s model: the reference transformer, pooled, and the ``head`` group's
    `ParallelClassifierHead` (classes over TP, or over every rank)."""
    if cfg.model.name == "hf":
        raise ConfigError("model=hf fine-tunes a causal LM with launch/train.py; launch/classify.py trains bigdense's "
                          "encoder (model=encoder_tiny or a model option of the same shape keys)")
    head = cfg.head
    margin = head.margin if head.margin is None or isinstance(head.margin, str) else tuple(head.margin)
    with torch.device(ctx.device):
        return TextClassifier(gpt_config(cfg, vocab_size), num_classes, tp_group=ctx.tp_group,
                              dp_group=ctx.dp_group, shard=head.shard, sample_rate=head.sample_rate, margin=margin,
                              scale=head.scale, softcap=head.softcap, z_loss=head.z_loss)
