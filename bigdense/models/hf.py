"""A Hugging Face causal language model as bigdense's engines and jobs call a model.

bigdense's engines call ``loss = model(x, y)`` (`bigdense.train.engines.base`): ``x`` the input
ids, ``y`` the next ids (``-100`` ignored). A transformers causal LM takes ``input_ids`` and returns
logits (and, given ``labels``, a loss over labels it shifts itself). `CausalLM` is the bridge: it
holds the transformers model, converted by `bd.parallelize` or not, as ``lm`` (so its parameters
are ``lm.<transformers name>``) and returns the mean cross-entropy of its logits against ``y``, in
fp32. transformers itself is not imported here.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalLM(nn.Module):
    """``loss = CausalLM(hf_model)(x, y)``: mean cross-entropy of ``hf_model(input_ids=x).logits``
    against ``y`` over the tokens whose target is not -100, computed in fp32."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x, use_cache=False).logits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
