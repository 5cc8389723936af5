"""The fused vocab-parallel cross-entropy's working set, per TP rank: the one model of it, for every
loss that runs through it -- the reference GPT's head (`bigdense.plan.gpt`) and a Hugging Face
model's output head under `CausalLM` (`bigdense.plan.hf`).

Counted from `bigdense.layers.head.fused_ce` and its two chunk loops, with the ``"forward"``
gradient strategy (the default: the gradients are formed while each chunk's logits are at hand):

* the gradients, formed in the forward and held by the loss until its backward hands them on:
  the hidden states' (tokens x d) and the weight's (this rank's classes x d, when the weight
  trains); fp32 on the CPU loop (`ce_chunks`), on the GPU loop (`ce_gpu`) the hidden states' in
  the matmul dtype and the weight's in the parameters' dtype;
* the buffers of one call, reused by every chunk: the logits of a chunk of tokens -- on the CPU loop
  fp32 in `logits_slots` slots (a second fp32 buffer per slot with a softcap, whose chunk is half as
  thick), under a low-precision matmul also their compute-width copy and a block of weight-gradient
  rows; on the GPU loop `kernel_slots` buffers in the matmul dtype, and every rank's (`STATS`,
  tokens) fp32 statistics: this rank's, the gathered chunks, and their join;
* the CPU loop's (chunk, d) temporaries, one statement's at a time: in fp32 without a softcap one
  fp32 tensor (the weight's rows at the targets, then the token-scaled hidden states:
  `ce_chunks._fp32_grads_unscaled`); in low precision the hidden states' gradient rows (the
  matmul's output, then its fp32 copy), freed before the token-scaled hidden states are made;
* the operands cast once per call to the matmul dtype: the hidden states unless the head is given
  them at that width, the weight unless the parameters are in it;
* with sequence parallelism, the hidden states gathered along the sequence.

The chunk size is the head's own (`fused_ce.loss_chunk_tokens`) unless one is given, and never more
than the tokens. Per-token vectors (targets, weights, statistics of the CPU loop: tens of bytes a
token) are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.softmax_ce import STATS
from ..layers.head.ce_chunks import WEIGHT_GRAD_BLOCK_BYTES, logits_slots
from ..layers.head.ce_gpu import kernel_path, kernel_slots
from ..layers.head.fused_ce import loss_chunk_tokens

# The head's matmul dtype by the layout's precision (which loop runs it depends on it).
MATMUL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FusedHeadMemory:
    """Bytes of one fused loss call on the rank with the most classes.

    ``tokens``: the tokens the loss scores (a micro-batch; the whole sequence under SP);
    ``classes``: the most classes a rank of ``tp`` holds; ``tp``: the ranks the classes are split
    over (1 for a head that is not split); ``compute_bytes``: the matmul dtype's width;
    ``input_bytes``: the width of the hidden states the head is given; ``param_bytes``: the
    weight's; ``weight_grad``: whether the weight trains (a frozen tied head: no gradient)."""

    tokens: int
    classes: int
    d_model: int
    tp: int
    compute_bytes: int
    input_bytes: int
    param_bytes: int
    device_type: str
    precision: str
    chunk_size: Optional[int] = None  # None: the head's automatic chunk
    sequence_parallel: bool = False
    softcap: bool = False
    weight_grad: bool = True

    @classmethod
    def of_vocabulary(cls, vocab_size: int, tp: int, **sizes) -> "FusedHeadMemory":
        """The head of ``vocab_size`` classes split over ``tp`` ranks (balanced: the first hold one more)."""
        return cls(classes=math.ceil(vocab_size / tp), tp=tp, **sizes)

    @property
    def kernel(self) -> bool:
        """Whether the GPU loop (`ce_gpu`) runs the loss."""
        return kernel_path(self.device_type, MATMUL_DTYPES[self.precision])

    def chunk_tokens(self) -> int:
        auto = loss_chunk_tokens(self.classes, self.device_type, MATMUL_DTYPES[self.precision], self.tp,
                                 softcap=self.softcap)
        return max(1, min(self.chunk_size or auto, self.tokens))

    def gradient_bytes(self) -> float:
        """The gradients formed in the forward: the hidden states' and the weight's."""
        d, c = self.d_model, self.compute_bytes
        weight = self.classes * d * (self.param_bytes if self.kernel else 4) if self.weight_grad else 0
        return self.tokens * d * (c if self.kernel else 4) + weight

    def weight_gradient_bytes(self, param_bytes: Optional[int] = None) -> float:
        """The weight's gradient as the backward finds it, in the parameters' dtype (the largest shard)."""
        return self.classes * self.d_model * (param_bytes or self.param_bytes) if self.weight_grad else 0

    def chunk_bytes(self) -> float:
        """The call's buffers and the operands cast for it (see the module docstring)."""
        d, c, chunk = self.d_model, self.compute_bytes, self.chunk_tokens()
        cast = (self.tokens * d * c if self.input_bytes != c else 0) + (
            self.classes * d * c if self.param_bytes != c else 0)
        gathered = self.tokens * d * self.input_bytes if self.sequence_parallel else 0
        if self.kernel:
            stats = self.tokens * STATS * 4 * (1 + 2 * self.tp)  # this rank's, the gathered chunks, their join
            return kernel_slots(self.tp) * self.classes * chunk * c + stats + cast + gathered
        fp32 = (2 if self.softcap else 1) * logits_slots(self.tp, self.device_type) * self.classes * chunk * 4
        if c == 4:  # nothing is cast; without a softcap, one (chunk, d) temporary at a time
            return fp32 + (0 if self.softcap else chunk * d * 4) + gathered
        block_rows = min(self.classes, max(1, WEIGHT_GRAD_BLOCK_BYTES // (d * c)))
        low = self.classes * chunk * c + (block_rows * d * c if self.weight_grad else 0)
        return fp32 + cast + low + chunk * d * (c + 4) + gathered

    def bytes(self) -> dict[str, float]:
        """``{"grads", "chunk"}``: the loss's working set, all alive at the end of its forward."""
        return {"grads": self.gradient_bytes(), "chunk": self.chunk_bytes()}
