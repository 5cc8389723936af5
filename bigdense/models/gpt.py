"""A GPT-style decoder built only from bigdense layers.

Per TP rank (B batch, S sequence, d = d_model, H heads, tp the TP size):
- ``tok_emb``: VocabParallelEmbedding, rows of the vocabulary split over TP; output (B, S, d)
  replicated. ``pos_emb``: an ordinary nn.Embedding, replicated.
- each block: LayerNorm → attention (H/tp heads per rank) → residual; LayerNorm → ParallelMLP →
  residual. Activations between blocks are (B, S, d), the same on every TP rank.
- ``head``: ParallelClassifierHead over the vocabulary, optionally tied to ``tok_emb``; the loss is
  the fused vocab-parallel cross-entropy, so no rank ever holds (B·S, vocab) logits.

One forward has 2 all-reduces per block (attention output, MLP output) plus the embedding's and
the loss statistics'; the backward mirrors them.

With ``sequence_parallel=True`` the activations between blocks, the LayerNorms, residuals and
dropouts hold this rank's balanced share of the sequence, (B, S_local, d): each block then does 2
all-gathers (entering attention and the MLP) and 2 reduce-scatters (leaving them) forward, the
mirror image backward plus 2 all-gathers re-gathering the column inputs, and saves 1/tp of the
activations. The replicated parameters (LayerNorms, row biases) have their gradients summed over
TP in backward; the position embeddings' gradient is all-gathered. Parameters, state dicts and checkpoints do not change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelClassifierHead,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    tie_weights,
)
from ..layers.base import global_numel, sequence_dropout
from ..parallel.context import resolve_tp_group
from ..parallel.comm import group_rank, group_size
from ..parallel.dropout import tp_dropout
from ..parallel.regions import scatter_to_sequence
from ..parallel.sharding import mark_logical_blocks, shard_sizes
from ..errors import ConfigError

ATTENTION_DROPOUT_MODES = ("invariant", "fused")


@dataclass
class GPTConfig:
    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_hidden: Optional[int] = None  # None: 4 * d_model
    max_seq_len: int = 256
    dropout: float = 0.0  # embeddings, attention output, MLP output
    attention_dropout: float = 0.0  # on the attention probabilities; 0 keeps the fused SDPA kernels
    attention_dropout_mode: str = "invariant"  # "invariant" (layout-free masks) or "fused" (SDPA's own)
    activation: str = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    head_chunk_size: Optional[int] = None  # None: the head picks a chunk from a memory budget
    softcap: Optional[float] = None  # the head's logits are softcap * tanh(z / softcap) (None: plain)
    z_loss: float = 0.0  # the loss adds z_loss * lse**2 per token (PaLM's z-loss; 0: none)
    init: str = "trunc_normal"
    sequence_parallel: bool = False  # activations between TP regions split along the sequence
    overlap_comm: bool = True  # column layers' backward collectives overlap their weight-gradient GEMMs
    # {module path: rank}: these dense layers are built as `bd.low_rank` pairs of that rank (the
    # structure of a checkpoint written by `python -m bigdense.compress`).
    low_rank: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, model_cfg, vocab_size: int, parallel_cfg=None) -> "GPTConfig":
        """From the ``model`` config group (`bigdense.config.ModelConfig`): every key of the same
        name; ``vocab_size`` is ``model.vocab_size`` or, when that is null, the tokenizer's. From
        the ``parallel`` group, when given: ``sequence_parallel`` and ``overlap_comm``."""
        keys = {f.name for f in fields(cls)} - {"vocab_size"}
        values = {k: getattr(model_cfg, k) for k in keys if hasattr(model_cfg, k)}
        values["low_rank"] = dict(values.get("low_rank") or {})
        if parallel_cfg is not None:
            values.update(sequence_parallel=bool(parallel_cfg.sequence_parallel),
                          overlap_comm=bool(parallel_cfg.overlap_comm))
        return cls(vocab_size=getattr(model_cfg, "vocab_size", None) or vocab_size, **values)


def check_heads(d_model: int, n_heads: int, tp: int, *, owner: str = "", key: str = "",
                tp_key: str = "the TP size", world_size: Optional[int] = None) -> None:
    """The attention's shape rule, for the layer and for the config alike: heads divide ``d_model``
    and ``tp`` divides the heads (each rank holds whole heads). ``key`` prefixes the model keys in
    the message (``"model."`` for the config), ``tp_key`` names the TP size; with ``world_size``
    (a launch's process count) the advice lists only TP sizes that launch can run."""
    if d_model % n_heads:
        raise ConfigError(f"{owner}{key}n_heads={n_heads} must divide {key}d_model={d_model}")
    if n_heads % tp:
        choices = [d for d in range(1, n_heads + 1) if n_heads % d == 0 and (world_size is None or world_size % d == 0)]
        where = f" (divisors of both the heads and the {world_size} processes)" if world_size else ""
        raise ConfigError(f"{owner}{tp_key}={tp} must divide {key}n_heads={n_heads} (heads are split over TP); "
                          f"choose {tp_key} from {choices}{where}, or {key}n_heads divisible by {tp}")


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over TP.

    ``qkv`` is a ColumnParallelLinear(d, 3d) whose global output rows are laid out head by head
    (``[head 0: q, k, v][head 1: q, k, v]...``), so with ``tp`` dividing ``n_heads`` the balanced
    split gives every rank whole heads: weight (3d/tp, d). ``out`` is a RowParallelLinear(d, d):
    weight (d, d/tp), its all-reduce is the block's only collective here.
    Attention is ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPUs)
    unless the probabilities get dropout. ``attention_dropout`` > 0 in training then has two modes:

    * ``"invariant"``: scores, softmax and the mask are computed here; the mask acts on this rank's
      heads, a sharded region, and ``tp_dropout`` draws exactly those heads' slice of the unsharded
      mask: the same numbers at any TP and DP size, but the (B, H/tp, S, S) probabilities are
      materialised.
    * ``"fused"``: SDPA's own dropout, fused into its kernel. Fast, but its masks come from the
      device generator and depend on the layout (TP size, DP size), as in every other framework.

    ``dropout`` acts on the attention output (a replicated region, or this rank's share of the
    sequence), with ``tp_dropout``. With ``sequence_parallel`` the input and output are this rank's
    share of the sequence (``forward(x, seq_len=S)``); the heads see all of it.
    """

    def __init__(
        self, d_model, n_heads, *, dropout=0.0, attention_dropout=0.0, attention_dropout_mode="invariant",
        bias=True, init="trunc_normal", tp_group=None, sequence_parallel=False, overlap_comm=True,
    ):
        super().__init__()
        if attention_dropout_mode not in ATTENTION_DROPOUT_MODES:
            raise ValueError(
                f"ParallelSelfAttention: attention_dropout_mode must be one of {ATTENTION_DROPOUT_MODES}, "
                f"got {attention_dropout_mode!r}"
            )
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"ParallelSelfAttention: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.attention_dropout, self.attention_dropout_mode = float(attention_dropout), attention_dropout_mode
        tp_group = resolve_tp_group(tp_group)
        tp = group_size(tp_group)
        check_heads(d_model, n_heads, tp, owner="ParallelSelfAttention: ")
        self.n_heads, self.head_dim, self.dropout = n_heads, d_model // n_heads, dropout
        self.heads_local = n_heads // tp
        self.tp_size, self.tp_rank = tp, group_rank(tp_group)
        self.head_start = self.tp_rank * self.heads_local
        self.sequence_parallel = sequence_parallel
        kw = dict(bias=bias, init=init, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, overlap_comm=overlap_comm, **kw)
        # Three matrices, q, k and v, interleaved head by head (an optimizer may treat each alone).
        rows = torch.arange(3 * d_model, device="cpu").view(n_heads, 3, self.head_dim)  # indices, not data: on the CPU
        mark_logical_blocks(self.qkv.weight, 0, [rows[:, j].reshape(-1) for j in range(3)])
        self.out = RowParallelLinear(d_model, d_model, **kw)

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        # (A `bd.low_rank` pair standing in for qkv takes the input alone; it is never sequence-parallel.)
        qkv = self.qkv(x, seq_len) if self.sequence_parallel else self.qkv(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, self.heads_local, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        p = self.attention_dropout if self.training else 0.0
        if p > 0 and self.attention_dropout_mode == "invariant":
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            probs = tp_dropout(probs, p, shard_dim=1, global_size=self.n_heads, offset=self.head_start)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = self.out(y.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim))
        shares = shard_sizes(s, self.tp_size) if self.sequence_parallel else None
        return sequence_dropout(y, self.dropout, self.training, shares, self.tp_rank)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    ``forward(x, seq_len=None)``: ``x`` (B, S, d), or (B, S_local, d) under sequence parallelism,
    where ``seq_len=S`` spares the layers an exchange of the ranks' lengths.
    """

    def __init__(self, cfg: GPTConfig, tp_group=None):
        super().__init__()
        sp = dict(sequence_parallel=cfg.sequence_parallel, tp_group=tp_group)
        self.ln1 = LayerNorm(cfg.d_model, **sp)
        self.attn = ParallelSelfAttention(
            cfg.d_model, cfg.n_heads, dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
            attention_dropout_mode=cfg.attention_dropout_mode, bias=cfg.bias, init=cfg.init,
            overlap_comm=cfg.overlap_comm, **sp,
        )
        self.ln2 = LayerNorm(cfg.d_model, **sp)
        self.mlp = ParallelMLP(
            cfg.d_model, cfg.d_hidden or 4 * cfg.d_model, cfg.activation,
            dropout=cfg.dropout, bias=cfg.bias, init=cfg.init, overlap_comm=cfg.overlap_comm, **sp,
        )

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), seq_len)
        return x + self.mlp(self.ln2(x), seq_len)


def add_trunk(module: nn.Module, cfg: GPTConfig, tp_group) -> dict:
    """Give ``module`` the GPT's trunk, read by `GPT.hidden`: ``tp_group``, ``tok_emb``, ``pos_emb``,
    ``blocks``, ``ln_f``. Returns the sequence-parallel options the trunk's layers were built with."""
    module.tp_group = tp_group = resolve_tp_group(tp_group)
    sp = dict(sequence_parallel=cfg.sequence_parallel, tp_group=tp_group)
    module.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, init=cfg.init, **sp)
    module.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
    nn.init.normal_(module.pos_emb.weight, std=0.02)
    module.blocks = nn.ModuleList(Block(cfg, tp_group) for _ in range(cfg.n_layers))
    module.ln_f = LayerNorm(cfg.d_model, **sp)
    return sp


def trunk_edges(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules a trunk-bearing model runs before its blocks and after them, for sharding by
    unit (`bigdense.train.engines.fsdp.apply_fsdp`): the embeddings, and the final norm with the head."""
    return [module.tok_emb, module.pos_emb], [module.ln_f, module.head]


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx, targets)`` returns the mean cross-entropy.

    ``idx``/``targets``: (B, S) int64, the same on every TP rank. Without targets, ``forward``
    returns this rank's shard of the logits, (B, S, vocab_local).
    """

    def __init__(self, cfg: GPTConfig, tp_group=None):
        super().__init__()
        self.cfg = cfg
        sp = add_trunk(self, cfg, tp_group)
        self.head = ParallelClassifierHead(
            cfg.d_model, cfg.vocab_size, bias=False, chunk_size=cfg.head_chunk_size, init=cfg.init,
            softcap=cfg.softcap, z_loss=cfg.z_loss, **sp
        )
        if cfg.tie_embeddings:
            tie_weights(self.tok_emb, self.head)
        for path, rank in cfg.low_rank.items():
            self._make_low_rank(path, int(rank))

    def _make_low_rank(self, path: str, rank: int) -> None:
        from ..layers.base import replace_module
        from ..compression.lowrank import low_rank_like

        try:
            layer = self.get_submodule(path)
        except AttributeError:
            raise ValueError(f"GPT: model.low_rank names {path!r}, which is not a module of this model") from None
        replace_module(self, path, low_rank_like(layer, rank))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states, (B, S, d_model), replicated over TP; under sequence
        parallelism this rank's share of the sequence, (B, S_local, d_model)."""
        s = idx.shape[1]
        if s > self.cfg.max_seq_len:
            raise ValueError(f"GPT: sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}")
        shares, rank = None, group_rank(self.tp_group)
        position = self.pos_emb(torch.arange(s, device=idx.device))
        if self.cfg.sequence_parallel:
            shares = shard_sizes(s, group_size(self.tp_group))
            # This rank's positions; the backward all-gathers the (S, d) gradient, so every rank
            # holds the table's full gradient.
            position = scatter_to_sequence(position, self.tp_group, shares)
        x = sequence_dropout(self.tok_emb(idx) + position, self.cfg.dropout, self.training, shares, rank)
        for block in self.blocks:
            x = block(x, s)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.hidden(idx), targets)

    def depth_and_width(self) -> tuple[int, int]:
        """``(layers, d_model)``, for the FLOPs of a token (`bigdense.train.flops`)."""
        return self.cfg.n_layers, self.cfg.d_model

    def edges(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The embeddings, and the final norm with the head (`trunk_edges`)."""
        return trunk_edges(self)

    def num_parameters(self) -> dict[str, int]:
        """Global parameter counts (unsharded), total and of the largest dense layer (the head)."""
        return {"total": global_numel(self), "head": self.cfg.vocab_size * self.cfg.d_model}
