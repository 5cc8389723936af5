"""Activation and loss-head memory of the reference GPT (`bigdense.models.GPT`), per TP rank.

Counted from what autograd keeps for the backward, tensor by tensor, following the code of
`bigdense.models.gpt`, `ParallelMLP` and `tp_dropout`; the loss head, the fused vocab-parallel
cross-entropy, by `bigdense.plan.fused_head`. Units: ``u = b*s*d`` elements (one residual-stream
tensor of a micro-batch), ``hid = b*s*d_hidden``, ``P2 = b*(heads/tp)*s*s`` (one rank's attention
matrix).

Per block, what stays for the backward:

* LayerNorm outputs, read by the next matmul: ``u`` each at 4 bytes, or under autocast the
  matmul's cast copy at the compute width (the fp32 output is then freed); the column projections
  of one input (SwiGLU's gate and up) share one copy.
* ``qkv``: ``3u/tp``; the attention output before ``out``: ``u/tp`` (computed widths).
* attention dropout > 0 (explicit softmax; SDPA's fused dropout on a GPU keeps none of it):
  softmax output, its dropout mask (1 byte), the dropped probabilities (``P2`` each); CUDA autocast runs softmax in fp32, so there the probabilities are
  4 bytes and ``probs @ v`` keeps a cast copy. Dropout 0: SDPA keeps only its output and
  log-sum-exp, no ``s x s`` matrix.
* the residual stream after attention and after the MLP (``u`` at 4 bytes each: autocast adds
  compute-width branches into the fp32 stream), dropout masks (``u`` at 1 byte) after each branch.
* MLP: GELU keeps its input and the down projection its output (``2 hid/tp``); ReLU keeps only
  its output (``hid/tp``); SwiGLU keeps gate, up, ``silu(gate)`` and their product (``4 hid/tp``).
* autocast's weight cache: a compute-width copy of each row-parallel weight (``out``, ``down``),
  alive until the forward's autocast exits and kept for the backward; the column projections cast
  their weights themselves and keep none.
* parameters in the compute dtype (DeepSpeed; FSDP's gathered copies, under autocast): the stream
  in that dtype, no weight copies; CUDA autocast still returns the final norm's output in fp32,
  which the head casts.

Sequence parallelism divides the replicated-region terms (norm outputs and the column projections'
saved inputs, residuals, masks) by tp; the head then gathers the final hidden states (``u``).

Low-rank adapters (`bigdense.layers.lora`, `GPTAdapters`), the rest of the model frozen: each
adapted layer keeps ``z = A x`` (``t*r`` at the compute width; a row layer's under SP ``t*r/tp``)
and its input, which is the input the layer keeps anyway, except under autocast, where the
adapter casts its own copy of a column layer's input (``u/rep`` at ``c``; row layers are given
their input at ``c`` already); with adapter dropout > 0 also its mask (1 byte) and, for a column
layer, the dropped input (at ``c`` under autocast, else its width: a frozen row layer keeps no
input of its own, so the dropped one replaces it). A frozen row layer without an adapter keeps no
input (``out``'s ``u/tp``, ``down``'s ``hid/tp`` unless ReLU keeps it). The frozen embedding's
output needs no gradient, so the first block's norm keeps none of it (no ``embedding`` row), and
the first block's column layers keep no cast of their own beside the adapters'. The head's weight
and the down projection's form no gradient; autocast's cache keeps the factors' compute-width
copies. Not followed: the other layers before the first adapter, which need no gradient either,
are counted as trained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .fused_head import FusedHeadMemory
from .layout import Layout


@dataclass(frozen=True)
class GPTAdapters:
    """The low-rank adapters of a reference GPT (`bigdense.layers.lora`) as its activation model
    reads them: their rank and dropout, per block the adapted layers as ``(name in the block, kind,
    in_features, elements of the factors on the largest rank)`` (kind ``"column"`` or ``"row"``), and which of
    the parameters the activations depend on train (under adapters none: the base is frozen)."""

    r: int
    dropout: float
    blocks: tuple  # per block: ((name, kind, in_features, factor elements), ...)
    embedding_trains: bool = False
    head_trains: bool = False
    down_trains: bool = False

    @classmethod
    def of(cls, model, entries, tp: int) -> Optional["GPTAdapters"]:
        """``model``'s adapters (its parameters: ``entries``, `param_entries` at ``tp``), or None."""
        from ..layers.lora import adapted_kind, adapted_layers, lora_settings

        layers = adapted_layers(model)
        if not layers:
            return None
        sizes = {e.name: e.local_numel(tp, 0) for e in entries}
        blocks = []
        for i in range(len(model.blocks)):
            prefix = f"blocks.{i}."
            blocks.append(tuple((n[len(prefix):], adapted_kind(m).kind, adapted_kind(m).in_features,
                                 sizes[f"{n}.lora_A.weight"] + sizes[f"{n}.lora_B.weight"])
                                for n, m in layers.items() if n.startswith(prefix)))
        settings = lora_settings(next(iter(layers.values())))
        down = getattr(model.blocks[0].mlp, "down", None)
        return cls(settings.r, settings.dropout, tuple(blocks), model.tok_emb.weight.requires_grad,
                   model.head.weight.requires_grad, down is not None and down.weight.requires_grad)


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_hidden: int
    seq_len: int
    activation: str = "gelu"
    dropout: float = 0.0
    attn_dropout: float = 0.0
    attn_dropout_mode: str = "invariant"  # "fused": SDPA's own dropout (no s x s matrix on GPUs)
    bias: bool = True
    tie_embeddings: bool = True
    head_chunk_size: Optional[int] = 1024  # None: the head's automatic chunk (from its largest shard)
    softcap: float = 0.0  # the head's logit softcap (0: none)

    @classmethod
    def from_model(cls, model, seq_len: int) -> "GPTShape":
        c = model.cfg
        return cls(
            vocab_size=c.vocab_size, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads,
            d_hidden=c.d_hidden or 4 * c.d_model, seq_len=seq_len, activation=c.activation, dropout=c.dropout,
            attn_dropout=c.attention_dropout, attn_dropout_mode=c.attention_dropout_mode, bias=c.bias,
            tie_embeddings=c.tie_embeddings, head_chunk_size=c.head_chunk_size, softcap=c.softcap or 0.0,
        )

    def block_weights(self) -> int:
        mlp_mats = 3 if self.activation == "swiglu" else 2
        return 4 * self.d_model * self.d_model + mlp_mats * self.d_model * self.d_hidden


class GPTMemory:
    """Bytes per TP rank of one micro-batch's activations and of the loss head, for a `Layout`."""

    loss_in_head = True  # the fused head computes the loss inside its forward

    def __init__(self, shape: GPTShape, layout: Layout, adapters: Optional[GPTAdapters] = None):
        self.shape, self.layout, self.adapters = shape, layout, adapters
        b, s, d, tp = layout.micro_batch_size, shape.seq_len, shape.d_model, layout.tp
        self.u = b * s * d
        self.hid = b * s * shape.d_hidden
        self.p2 = b * (shape.n_heads // tp) * s * s
        self.tokens = b * s
        self.c = layout.compute_bytes
        # Width of the residual stream and of norm outputs: fp32 under autocast, else the compute width.
        self.f = 4 if layout.autocast or layout.precision == "fp32" else self.c
        # Width of the final norm's output (what the head reads): the stream's, or fp32 by CUDA autocast.
        self.n = 4 if layout.cuda_autocast else self.f
        self.rep = tp if layout.sequence_parallel else 1  # replicated-region terms are split by SP

    # ---- pieces of one block ----
    def _norm_out(self) -> float:
        return self.u * (self.c if self.layout.autocast else self.f) / self.rep

    def _mask(self) -> float:
        return self.u / self.rep if self.shape.dropout > 0 else 0

    def explicit_attention(self) -> bool:
        """Whether the (b, heads/tp, s, s) probabilities are stored: attention dropout in training,
        computed here ("invariant") or by SDPA's math path (CPU; GPU kernels fuse it)."""
        sh = self.shape
        return sh.attn_dropout > 0 and (sh.attn_dropout_mode != "fused" or self.layout.device_type == "cpu")

    def attention_bytes(self) -> float:
        tp, c = self.layout.tp, self.c
        out = self._norm_out() + 3 * self.u / tp * c + self.u / tp * c
        if self.explicit_attention():
            fp32_softmax = self.layout.cuda_autocast
            sm = 4 if fp32_softmax else c
            out += self.p2 * (sm + 1 + sm + (c if fp32_softmax else 0))
        else:
            out += self.tokens * (self.shape.n_heads // tp) * 4  # SDPA's log-sum-exp
        return out + self._mask() + self.u * self.f / self.rep  # mask after `out`, residual

    def mlp_bytes(self) -> float:
        tp, c = self.layout.tp, self.c
        kept = {"gelu": 2, "relu": 1, "swiglu": 4}[self.shape.activation]
        return self._norm_out() + kept * self.hid / tp * c + self._mask() + self.u * self.f / self.rep

    def weight_cache_bytes(self) -> float:
        """autocast's compute-width copies of one block's row-parallel weights (``out``, ``down``),
        kept for the backward; the column projections cast theirs explicitly and keep none."""
        if not self.layout.autocast:
            return 0
        return (self.shape.d_model + self.shape.d_hidden) * self.shape.d_model / self.layout.tp * self.c

    def block_bytes(self, index: int = 1) -> float:
        return self.attention_bytes() + self.mlp_bytes() + self.adapter_bytes(index)

    def adapter_bytes(self, index: int) -> float:
        """What block ``index``'s adapters keep beyond its layers (see the module docstring)."""
        lora = self.adapters
        if lora is None:
            return 0
        c, tp, out = self.c, self.layout.tp, 0.0
        for n, (_, kind, in_features, _) in enumerate(lora.blocks[index]):
            column = kind == "column"
            # Its input: a column layer's the block's (this rank's share under SP), a row layer's
            # this rank's input features of every token.
            inputs = self.u / self.rep if column else self.tokens * in_features / tp
            out += self.tokens * lora.r * c / (1 if column else self.rep)  # z (a column's gathered under SP)
            # Under autocast a column adapter casts its own copy of the input; in the first block the
            # attention's input needs no gradient, so the layer keeps no cast beside it.
            first_input = index == 0 and n == 0 and not lora.embedding_trains
            if column and self.layout.autocast and not first_input:
                out += inputs * c
            if lora.dropout > 0:  # the mask; a column layer's base keeps its input beside the dropped one
                out += inputs * (1 + ((c if self.layout.autocast else self.f) if column else 0))
        # A frozen row layer with no adapter keeps no input (its weight forms no gradient): the
        # attention's output, and the MLP's hidden product unless the activation keeps it (ReLU).
        adapted = {name for name, *_ in lora.blocks[index]}
        if "attn.out" not in adapted:
            out -= self.u / tp * c
        if "mlp.down" not in adapted and self.shape.activation != "relu":
            out -= self.hid / tp * c
        return out

    def adapter_cache_bytes(self) -> float:
        """autocast's compute-width copies of every adapter factor, cached through the forward."""
        if self.adapters is None or not self.layout.autocast:
            return 0
        return sum(numel for block in self.adapters.blocks for *_, numel in block) * self.c

    def _recomputed(self, index: int) -> bool:
        mode = self.layout.recompute
        return mode == "full" or (mode == "every_k" and index % self.layout.recompute_every == 0)

    def stored_block_bytes(self, index: int) -> float:
        """What block ``index`` keeps through the forward, under the layout's recompute mode."""
        out = self.u * self.f / self.rep  # the block's output (the next block's, or the final norm's, input)
        if self._recomputed(index):
            return out
        if self.layout.recompute == "mlp":  # the MLP's input instead of its insides
            return self.attention_bytes() + self.u * self.f / self.rep + out + self.adapter_bytes(index)
        return self.block_bytes(index)

    def per_layer(self) -> list[tuple[str, float]]:
        """``[(name, bytes kept through the forward)]``: embedding, each block, final norm output."""
        f = self.u * self.f / self.rep
        frozen = self.adapters is not None and not self.adapters.embedding_trains  # nothing keeps its output
        rows = [("embedding", 0 if frozen else f + self._mask())]
        rows += [(f"blocks.{i}", self.stored_block_bytes(i)) for i in range(self.shape.n_layers)]
        return rows + [("ln_f", self.u * self.n / self.rep)]

    def stored_bytes(self) -> float:
        """Activations alive at the end of the forward, autocast's weight copies included."""
        cache = self.shape.n_layers * self.weight_cache_bytes() + self.adapter_cache_bytes()  # until autocast exits
        return sum(b for _, b in self.per_layer()) + cache

    def backward_block_bytes(self) -> float:
        """Bytes beyond every stored activation while the last block runs its backward, at its
        largest: what it recomputes, plus either its down projection's backward -- the stream's
        gradient and its dropout's, the gradients of the projection's input and weight, once the
        final norm's output, the block's output and its last dropout mask are freed -- or, with
        explicit attention probabilities, two ``s x s`` gradients and two of the stream in fp32."""
        tp, c = self.layout.tp, self.c
        recomputed = self.block_bytes(0) if self.layout.recompute != "none" else 0
        stream = self.u * self.f / self.rep
        freed = self.u * self.n / self.rep + stream + self._mask()
        down_trains = self.adapters is None or self.adapters.down_trains
        down = self.hid / tp * c + (self.shape.d_hidden * self.shape.d_model / tp * c if down_trains else 0)
        mlp = down + stream * (2 if self.shape.dropout > 0 else 1) - freed
        attention = 2 * self.p2 * c + 2 * self.u * 4 if self.explicit_attention() else mlp
        return recomputed + max(mlp, attention)

    # ---- the loss head ----
    def head(self) -> FusedHeadMemory:
        """The fused vocab-parallel CE of the head (`bigdense.plan.fused_head` counts it)."""
        sh, lay = self.shape, self.layout
        return FusedHeadMemory.of_vocabulary(
            sh.vocab_size, lay.tp, tokens=self.tokens, d_model=sh.d_model, compute_bytes=self.c, input_bytes=self.n,
            param_bytes=lay.param_bytes, device_type=lay.device_type, precision=lay.precision,
            chunk_size=sh.head_chunk_size, sequence_parallel=lay.sequence_parallel, softcap=bool(sh.softcap),
            weight_grad=self.adapters is None or self.adapters.head_trains)

    def head_bytes(self) -> dict[str, float]:
        """The fused vocab-parallel CE's working set: gradients formed in the forward, plus the
        buffers it allocates once per call and reuses for every chunk."""
        return self.head().bytes()

    # ---- the step ----
    def moments(self, base: float, persistent_grads: float, grads: float, temporaries: float) -> dict[str, float]:
        """Bytes alive at each moment of the step (`bigdense.plan.estimate` says which), given
        ``base`` (parameters, optimizer state, buckets), the gradients kept between steps, all the
        gradients, and the optimizer's temporaries."""
        acts, head, pb = self.stored_bytes(), self.head_bytes(), self.layout.param_bytes
        head_grad = self.head_weight_gradient_bytes(pb)
        # A tied weight's gradient waits in autograd's buffer for the embedding's, beside those kept
        # between steps; an untied one is added to them.
        held = persistent_grads + head_grad if self.shape.tie_embeddings else max(persistent_grads, head_grad)
        return {
            "forward": base + persistent_grads + acts + head["grads"] + head["chunk"],
            "backward": base + held + acts + self.backward_block_bytes(),
            "backward_end": base + grads + self.tied_gradient_bytes(pb),
            "optimizer": base + grads + temporaries,
        }

    def head_weight_gradient_bytes(self, param_bytes: int) -> float:
        """The head weight's gradient as the blocks' backward finds it (the largest rank's shard, in
        the parameters' dtype; the hidden states' gradient, formed in the forward too, is consumed)."""
        return self.head().weight_gradient_bytes(param_bytes)

    def head_backward_bytes(self) -> float:
        """Beyond the stored activations when the head's backward starts: the gradients the fused
        cross-entropy formed in the forward (fp32)."""
        return self.head_bytes()["grads"]

    def tied_gradient_bytes(self, param_bytes: int) -> float:
        """At the end of the backward, with the head tied to the embedding: the embedding's dense
        gradient and its sum with the head's, beside the head's (the largest rank's shard)."""
        trains = self.adapters is None or self.adapters.embedding_trains
        return 2 * self.head_weight_gradient_bytes(param_bytes) if self.shape.tie_embeddings and trains else 0

    def categories(self) -> dict[str, float]:
        """The activation rows of the memory table."""
        head = self.head_bytes()
        return {"activations": self.stored_bytes(), "head_loss": head["grads"] + head["chunk"],
                "comm_buffers": self.u * self.c}  # the TP all-reduce's output copy

    # ---- FLOPs ----
    def flops_per_micro_batch(self) -> float:
        """Matmul FLOPs of one micro-batch's forward and backward on one TP rank."""
        sh, tp = self.shape, self.layout.tp
        fwd_block = 2 * self.tokens * sh.block_weights() / tp + 4 * self.tokens * sh.seq_len * sh.d_model / tp
        fwd_mlp = 2 * self.tokens * (sh.block_weights() - 4 * sh.d_model ** 2) / tp
        fwd_head = 2 * self.tokens * sh.vocab_size * sh.d_model / tp
        total = 3 * (sh.n_layers * fwd_block + fwd_head)
        mode = self.layout.recompute
        if mode == "full":
            total += sh.n_layers * fwd_block
        elif mode == "every_k":
            total += math.ceil(sh.n_layers / self.layout.recompute_every) * fwd_block
        elif mode == "mlp":
            total += sh.n_layers * fwd_mlp
        return total
