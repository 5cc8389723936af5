"""A Hugging Face causal language model as bigdense's engines and jobs call a model.

bigdense's engines call ``loss = model(x, y)`` (`bigdense.train.engines.base`): ``x`` the input
ids, ``y`` the next ids (``-100`` ignored). A transformers causal LM takes ``input_ids`` and returns
logits (and, given ``labels``, a loss over labels it shifts itself). `CausalLM` is the bridge: it
holds the transformers model, converted by `bd.parallelize` or not, as ``lm`` (so its parameters
are ``lm.<transformers name>``) and returns the mean cross-entropy of its logits against ``y``, in
fp32: the loss is on every token whose target is not -100 (the jobs' data masks none). It also
gives the jobs what they ask of a model: its decoder layers as ``blocks`` (for ``torch.compile``
and activation checkpointing), global parameter counts, frozen input embeddings. transformers
itself is not imported here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers.base import global_numel


class CausalLM(nn.Module):
    """``loss = CausalLM(hf_model)(x, y)``: mean cross-entropy of ``hf_model(input_ids=x).logits``
    against ``y`` over the tokens whose target is not -100, computed in fp32. ``pretrained``: the
    ``save_pretrained`` directory the weights come from (the fine-tune job loads it after TP)."""

    def __init__(self, lm: nn.Module, pretrained: Optional[str] = None):
        super().__init__()
        self.lm = lm
        self.pretrained = pretrained

    @property
    def blocks(self) -> Optional[nn.ModuleList]:
        """The decoder layers (``model.layers`` in most architectures), None when there is no such list."""
        decoder = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else None
        for owner in (decoder, getattr(self.lm, "model", None), getattr(self.lm, "transformer", None)):
            for name in ("layers", "h", "blocks"):
                found = getattr(owner, name, None)
                if isinstance(found, nn.ModuleList):
                    return found
        return None

    def edges(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The input embeddings, and the decoder's final norm with the output head (units of
        `bigdense.train.engines.fsdp.apply_fsdp`); either list is empty where the model has none."""
        decoder = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else None
        inputs = [self.lm.get_input_embeddings()] if hasattr(self.lm, "get_input_embeddings") else []
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None
        outputs = [m for m in (getattr(decoder, "norm", None), head) if isinstance(m, nn.Module)]
        return [m for m in inputs if isinstance(m, nn.Module)], outputs

    def num_parameters(self) -> dict[str, int]:
        """Global parameter counts (unsharded): total, and of the output head (a tied head shares
        the embedding's)."""
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None
        return {"total": global_numel(self), "head": global_numel(head) if head is not None else 0}

    def depth_and_width(self) -> tuple[int, int]:
        """``(decoder layers, hidden size)``, for the FLOPs of a token (`bigdense.train.flops`)."""
        config = self.lm.config.get_text_config() if hasattr(self.lm.config, "get_text_config") else self.lm.config
        return config.num_hidden_layers, config.hidden_size

    def freeze_embeddings(self) -> list[str]:
        """Stop training the input embeddings (and an output head tied to them); the names frozen."""
        embeddings = self.lm.get_input_embeddings()
        embeddings.requires_grad_(False)
        return [name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x, use_cache=False).logits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
