"""Activation and loss-head memory of a Hugging Face causal LM (``model=hf``), per TP rank.

The model is the fine-tune job's: ``CausalLM(lm)`` with ``lm`` built by transformers from a
``save_pretrained`` directory's config.json (`meta_causal_lm`: on the meta device, nothing read but
the config) and converted by its own tensor-parallel plan. Its parameters are counted exactly
elsewhere (`bigdense.plan.count`, from the plan); here is what one training step adds.

Per decoder layer, what autograd keeps for the backward -- Korthikanti et al. 2022's per-layer count
(``sbh(34 + 5as/h)``) redone tensor by tensor for a standard pre-norm decoder as transformers writes
it (Llama, Mistral, Qwen2/3: RMSNorm, RoPE, grouped-query SDPA, a gated MLP or MoE) under bigdense's
engines. Units: ``t = b*s`` tokens, ``u = t*d`` (one hidden-state tensor); per rank ``qe =
t*heads*head_dim`` (queries), ``ke = t*kv_heads*head_dim`` (keys; values the same), ``hid =
t*intermediate`` (heads and intermediate divided by tp where the plan splits them). ``c``: bytes of
the compute dtype; ``w``: of the residual stream (4 under autocast and in fp32, else ``c``).

* each RMSNorm (computed in fp32): its fp32 input (a copy when the stream is not fp32), the
  normalised values at the input's width, a per-token rsqrt; its output as its consumers keep it:
  under autocast each projection casts its own copy (q, k and v three, gate and up two), else the
  one tensor is shared. q/k norms (Qwen3) the same per head (``4 + c`` bytes per element).
* attention by SDPA with no padding mask (the jobs pack full sequences): keys not repeated for
  grouped-query heads, no ``s x s`` matrix. q, k, v at ``c`` (RoPE's fp32 products are cast back by
  autocast; RoPE itself keeps only cos and sin, shared by every layer), the output at ``c``, an fp32
  log-sum-exp per head and token. Dropout is taken as 0 (fine-tuning configs ship it so).
* the residual stream after attention and after the MLP: ``w*u`` each.
* gated MLP: gate, act(gate), up and their product (``4c*hid``); a plain one keeps the activation's
  input and output (``2c*hid``).
* MoE (approximate): per routed (token, expert) pair, the gathered input, gate-up output,
  act(gate), product and output; the router's logits and fp32 probabilities; a shared expert as a
  gated MLP. Measured on a Qwen3-MoE layer (transformers' grouped-mm experts): within 0.15% in
  fp32, 0.7-2.6% under in bf16 (the experts' own casts and index tensors are not followed).
* autocast keeps a compute-width copy of every weight matrix a matmul casts, until that matmul's
  backward: every matrix of a layer but those of bigdense's column-parallel layers (tp > 1), which
  cast their own and keep none; the output head's too at tp = 1 on the gathered path (the fused
  loss casts the weight itself, for its call only).
* the embedding's output (the first norm's input), unless the embeddings are frozen.

Recompute (``full``, ``every_k``, ``mlp``) keeps a checkpointed layer's input (the stream; for
``mlp`` the MLP's input, the norm's output at ``w``) instead of its insides; a layer's backward
recomputes them all but its output (non-reentrant checkpointing stops at the last saved tensor).
A layer's backward also holds gradients of activations: that term (`HFMemory.gradient_bytes`) is
fitted to the measured step, not derived op by op, and on the gathered path the output head's own
backward buffers are not modelled (they set the peak only when a small micro-batch leaves the
gradients on top).

Other architectures are read through the same template: their sizes from the config's usual keys,
their kind of layer from its modules (q/k norms, a gated or plain MLP, experts); what they keep
beyond it (biases, sliding-window masks, scaled embeddings, LayerNorm's mean) is not counted.

The loss: `CausalLM` computes it through bigdense's fused vocab-parallel cross-entropy from the
hidden states its output head is given and the head's shard of the weight (`bigdense.models.hf_loss`),
counted by `bigdense.plan.fused_head` as for the reference GPT: no logits, the gradients of the
hidden states and of the head's weight formed in the forward, one call's chunk buffers (the head's
automatic chunk; a softcap from the loss path's transform or the config's
``final_logit_softcapping``); nothing of the head's input is kept for the backward. A scaled
model's (Cohere, Granite) copy of the hidden states, ``t*d``, is not counted. The path is the
`CausalLM`'s: its ``loss_path`` when decided, else fused unless ``fused_loss=False``. The gathered
path (``fused_loss=False``, or a model whose transform was not proved) computes the full logits (the
head's shards gathered over TP) at ``c``, ``.float()`` copies them (when ``c`` is not 4) and
``F.cross_entropy`` keeps log-softmax's fp32 output: ``(c + 4 + 4)*t*V`` inside the loss; its
backward holds three fp32 ``t*V`` tensors at once (the saved output, nll's gradient, log-softmax's
gradient): with a large vocabulary the step's peak (``loss_backward``). Sequence parallelism does
not apply (`bd.parallelize` does not split HF activations along the sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from ..models import CausalLM
from ..models.hf_dir import HFDirectory
from .fused_head import FusedHeadMemory
from .layout import Layout

# How transformers names a decoder layer's parts (Llama and most causal LMs since).
ATTENTION_NAMES = ("self_attn", "attention", "attn")
GATED_MLP_NAMES = ("gate_proj", "gate_up_proj", "w1")


def meta_causal_lm(path, freeze_embeddings: bool = False, fused_loss: bool = True) -> CausalLM:
    """The Hugging Face causal LM of the ``save_pretrained`` directory ``path`` on the meta device,
    in a `CausalLM`, as the job builds it (`HFDirectory.meta_model`); nothing is read but its config.json."""
    model = CausalLM(HFDirectory.open(path).meta_model(), fused_loss=fused_loss)
    if freeze_embeddings:
        model.freeze_embeddings()
    return model


@dataclass(frozen=True)
class HFShape:
    """The sizes of a causal LM's config the estimate reads (global, before TP)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_hidden: int  # a dense MLP's intermediate size
    seq_len: int
    experts: int = 0
    experts_per_token: int = 0
    d_expert: int = 0  # one expert's intermediate size
    d_shared_expert: int = 0
    tie_embeddings: bool = False

    @classmethod
    def from_config(cls, config, seq_len: int, tie_embeddings: Optional[bool] = None) -> "HFShape":
        """From a transformers config (a multimodal one's text config); the usual key names first.
        ``tie_embeddings``: as the built model has it (default: the config's ``tie_word_embeddings``)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        d, heads = _first(c, "hidden_size", "n_embd", "d_model"), _first(c, "num_attention_heads", "n_head")
        experts = _first(c, "num_experts", "num_local_experts", "n_routed_experts")
        if tie_embeddings is None:
            tie_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return cls(
            vocab_size=c.vocab_size, d_model=d, n_layers=_first(c, "num_hidden_layers", "n_layer"), n_heads=heads,
            n_kv_heads=_first(c, "num_key_value_heads", default=heads),
            head_dim=_first(c, "head_dim", default=d // heads),
            d_hidden=_first(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * d), seq_len=seq_len,
            experts=experts, experts_per_token=_first(c, "num_experts_per_tok", "moe_topk") if experts else 0,
            d_expert=_first(c, "moe_intermediate_size", "intermediate_size") if experts else 0,
            d_shared_expert=_first(c, "shared_expert_intermediate_size") if experts else 0,
            tie_embeddings=tie_embeddings,
        )


def _first(config, *names: str, default: int = 0) -> int:
    """The first of ``names`` that ``config`` sets (not None, not 0)."""
    return next((getattr(config, n) for n in names if getattr(config, n, None)), default)


@dataclass(frozen=True)
class HFLayer:
    """One decoder layer at one TP size: its kind, what TP splits, what autocast keeps, what trains."""

    qk_norm: bool
    mlp: str  # "gated", "plain" or "moe"
    heads_split: bool
    mlp_split: bool
    cached_attention: int  # elements of this rank's attention matrices autocast casts and keeps
    cached_mlp: int  # the same of the MLP's
    trainable: int  # elements of this rank's trainable parameters (their gradients)
    low_rank: int = 0  # elements of z = A x per token of its adapters (`bigdense.layers.lora`): the sum of their r
    frozen: bool = False  # its own weights (norms, projections) form no gradient (the base under adapters)

    @classmethod
    def read(cls, block: nn.Module, name: str, entries: dict, tp: int) -> "HFLayer":
        """``block`` (named ``name`` in the model) with ``entries`` ({parameter name: `ParamEntry`})."""
        attn_name = next((n for n in ATTENTION_NAMES if hasattr(block, n)), "self_attn")
        mine = {k[len(name) + 1:]: e for k, e in entries.items() if k.startswith(name + ".")}

        def split(part: str) -> bool:
            return tp > 1 and any(k.startswith(part + ".") and e.split_dim is not None for k, e in mine.items())

        def cached(part: str) -> int:
            # A column-parallel layer (a 2-D weight split by rows at tp > 1) casts its weight itself.
            return sum(e.local_numel(tp, 0) for k, e in mine.items() if k.startswith(part + ".")
                       and len(e.global_shape) >= 2 and not (tp > 1 and len(e.global_shape) == 2 and e.split_dim == 0))

        from ..layers.lora import is_lora_name, lora_settings

        low_rank = sum(lora_settings(m).r for m in block.modules() if lora_settings(m) is not None)
        frozen = not any(e.trainable for k, e in mine.items() if not is_lora_name(k))
        return cls(qk_norm=isinstance(getattr(getattr(block, attn_name, None), "q_norm", None), nn.Module),
                   mlp=_mlp_kind(getattr(block, "mlp", None)),
                   heads_split=split(attn_name), mlp_split=split("mlp"), cached_attention=cached(attn_name),
                   cached_mlp=cached("mlp"), trainable=sum(e.local_numel(tp, 0) for e in mine.values() if e.trainable),
                   low_rank=low_rank, frozen=frozen)


def _mlp_kind(mlp: Optional[nn.Module]) -> str:
    if hasattr(mlp, "experts"):
        return "moe"
    return "gated" if any(hasattr(mlp, n) for n in GATED_MLP_NAMES) else "plain"


class HFMemory:
    """Bytes per TP rank of one micro-batch's activations and of the loss, for a `Layout`.

    ``head_trainable``: elements of this rank's trainable parameters whose gradients the backward
    forms before the decoder layers' (the output head, the final norm). ``fused_loss``: the loss
    runs through the fused head (`CausalLM`'s default), else the gathered logits; ``softcap``: the
    model's logits are softcapped; ``head_trains``: the head's weight has a gradient."""

    def __init__(self, shape: HFShape, layers: list[HFLayer], layout: Layout, *, head_split: bool,
                 head_trainable: int, frozen_embeddings: bool = False, fused_loss: bool = True,
                 softcap: bool = False, head_trains: bool = True):
        self.shape, self.layers, self.layout = shape, layers, layout
        self.head_split, self.head_trainable, self.frozen_embeddings = head_split, head_trainable, frozen_embeddings
        self.tp = layout.tp
        self.t = layout.micro_batch_size * shape.seq_len
        self.u = self.t * shape.d_model
        self.c = layout.compute_bytes
        self.w = 4 if layout.autocast or layout.precision == "fp32" else self.c  # the residual stream's width
        # The fused loss's working set (None: the gathered path). The head is given the final norm's
        # output, at the stream's width (RMSNorm's last product is outside autocast's list).
        self.fused_head = FusedHeadMemory.of_vocabulary(
            shape.vocab_size, self.tp if head_split else 1, tokens=self.t, d_model=shape.d_model, compute_bytes=self.c,
            input_bytes=self.w, param_bytes=layout.param_bytes, device_type=layout.device_type,
            precision=layout.precision, softcap=softcap, weight_grad=head_trains) if fused_loss else None

    @property
    def loss_in_head(self) -> bool:
        """Whether the loss is computed inside the output head's forward (FSDP keeps its unit gathered)."""
        return self.fused_head is not None

    @classmethod
    def of(cls, model: nn.Module, seq_len: int, layout: Layout, entries) -> "HFMemory":
        """The estimate of ``model`` (a `CausalLM`, or the transformers model it wraps) whose
        parameters are ``entries`` (`bigdense.plan.count.param_entries` at ``layout.tp``)."""
        wrapped = model if isinstance(model, CausalLM) else CausalLM(model)
        lm, by_name = wrapped.lm, {e.name: e for e in entries}
        names = {id(m): n for n, m in model.named_modules()}  # as `entries` name them
        if wrapped.blocks is None:
            raise ValueError(f"plan: {type(lm).__name__} has no list of decoder layers to estimate activations of")
        blocks = [names[id(block)] for block in wrapped.blocks]
        layers = [HFLayer.read(block, name, by_name, layout.tp) for block, name in zip(wrapped.blocks, blocks)]
        inputs, outputs = lm.get_input_embeddings(), lm.get_output_embeddings()
        shape = HFShape.from_config(lm.config, seq_len, tie_embeddings=outputs is not None
                                    and outputs.weight is inputs.weight)
        embedding = f"{names[id(inputs)]}.weight"
        head = by_name.get(f"{names.get(id(outputs))}.weight")
        if head is None and shape.tie_embeddings:  # a tied weight is one entry, under the embedding's name
            head = by_name.get(embedding)
        # Outside the layers, every gradient but an untied input embedding's comes before the layers'.
        before_layers = sum(e.local_numel(layout.tp, 0) for e in entries if e.trainable
                            and not any(e.name.startswith(b + ".") for b in blocks)
                            and (e.name != embedding or shape.tie_embeddings))
        return cls(shape, layers, layout, head_split=layout.tp > 1 and head is not None and head.split_dim is not None,
                   head_trainable=before_layers,
                   frozen_embeddings=not inputs.weight.requires_grad, fused_loss=_fused_loss(wrapped),
                   softcap=_softcapped(wrapped), head_trains=outputs is not None and outputs.weight.requires_grad)

    # ---- pieces of one layer ----
    def _local(self, n: int, split: bool) -> int:
        return -(-n // self.tp) if split else n  # the largest rank's share

    def _norm(self, elements: float, frozen: bool = False) -> float:
        """An RMSNorm over ``elements`` values of the stream: its fp32 input (a copy when the
        stream is not fp32; else the stream itself, counted where it is made), the normalised
        values at the input's width (kept for its weight's gradient: none when ``frozen``), the
        rsqrt per token."""
        return (4 * elements if self.w != 4 else 0) + (0 if frozen else self.w * elements) + 4 * self.t

    def _kept_output(self, elements: float, consumers: int) -> float:
        """A norm's output as ``consumers`` matmuls keep it: each its own cast under autocast, else one shared."""
        return consumers * self.c * elements if self.layout.autocast else self.w * elements

    def _qk_norm(self, elements: float, heads: int) -> float:
        """A per-head RMSNorm on a projection's output (width ``c``): fp32 input, normalised at ``c``."""
        return (4 + self.c) * elements + 4 * self.t * heads

    def attention_bytes(self, layer: HFLayer) -> float:
        sh, c = self.shape, self.c
        heads, kv = self._local(sh.n_heads, layer.heads_split), self._local(sh.n_kv_heads, layer.heads_split)
        qe, ke = self.t * heads * sh.head_dim, self.t * kv * sh.head_dim
        out = self._norm(self.u, layer.frozen) + self._kept_output(self.u, consumers=3)
        if layer.qk_norm:
            out += self._qk_norm(qe, heads) + self._qk_norm(ke, kv)
        out += c * (qe + 2 * ke) + c * qe + 4 * self.t * heads  # SDPA's q, k, v, output, log-sum-exp
        return out + self.w * self.u  # the stream after attention

    def mlp_width(self, layer: HFLayer) -> int:
        """This rank's intermediate size of the layer's MLP (of one expert in an MoE)."""
        return self._local(self.shape.d_expert if layer.mlp == "moe" else self.shape.d_hidden, layer.mlp_split)

    def mlp_inside_bytes(self, layer: HFLayer) -> float:
        """What the MLP keeps of its input (the norm's output) and inside, without its output."""
        if layer.mlp == "moe":
            return self._kept_output(self.u, consumers=1) + self._moe_bytes(layer)
        consumers, kept = (1, 2) if layer.mlp == "plain" else (2, 4)
        return self._kept_output(self.u, consumers) + kept * self.c * self.t * self.mlp_width(layer)

    def mlp_bytes(self, layer: HFLayer) -> float:
        return self._norm(self.u, layer.frozen) + self.mlp_inside_bytes(layer) + self.w * self.u  # the stream after the MLP

    def _moe_bytes(self, layer: HFLayer) -> float:
        """Routed experts (approximate): per (token, expert) pair its input and output rows
        (``2d``) and the gated expert's ``4 d_expert``; the router's logits and probabilities."""
        sh, c = self.shape, self.c
        pairs = self.t * sh.experts_per_token
        routed = pairs * (2 * sh.d_model + 4 * self.mlp_width(layer)) * c
        shared = 4 * c * self.t * self._local(sh.d_shared_expert, layer.mlp_split)
        router = self.t * sh.experts * (c + 4) + pairs * (8 + 4)  # logits, fp32 softmax; top-k ids and weights
        return routed + shared + router

    def _copies(self, elements: float) -> float:
        """Autocast's compute-width copies of ``elements`` weight values (none without autocast)."""
        return elements * self.c if self.layout.autocast else 0

    def weight_cache_bytes(self, layer: HFLayer) -> float:
        return self._copies(layer.cached_attention + layer.cached_mlp)

    def layer_bytes(self, layer: HFLayer) -> float:
        return self.attention_bytes(layer) + self.mlp_bytes(layer) + self.low_rank_bytes(layer)

    def low_rank_bytes(self, layer: HFLayer) -> float:
        """Its adapters' ``z = A x`` (tokens x r each, at the compute width); their inputs are the
        ones its projections keep (a frozen projection keeps none: its adapter keeps it instead)."""
        return self.t * layer.low_rank * self.c

    def _recomputed(self, index: int) -> bool:
        mode = self.layout.recompute
        return mode == "full" or (mode == "every_k" and index % self.layout.recompute_every == 0)

    def stored_layer_bytes(self, index: int) -> float:
        """What layer ``index`` keeps through the forward under the recompute mode, autocast's
        weight copies included."""
        layer = self.layers[index]
        if self._recomputed(index):
            return self.w * self.u  # its output, the next layer's checkpointed input
        if self.layout.recompute == "mlp":  # the MLP's checkpointed input (the norm's output, at w), its output
            kept = self.attention_bytes(layer) + self._norm(self.u, layer.frozen) + 2 * self.w * self.u
            return kept + self._copies(layer.cached_attention)
        return self.layer_bytes(layer) + self.weight_cache_bytes(layer)

    def recomputed_bytes(self, index: int) -> float:
        """What layer ``index``'s backward recomputes and holds (with its weight copies): all of it
        but its output (recompute stops at the last saved tensor), or the MLP's inside."""
        layer = self.layers[index]
        if self._recomputed(index):
            return self.layer_bytes(layer) + self.weight_cache_bytes(layer) - self.w * self.u
        if self.layout.recompute == "mlp":  # without fp32 copies, its input is the checkpointed one
            shared_input = 0 if self.layout.autocast else self._kept_output(self.u, consumers=1)
            return self.mlp_inside_bytes(layer) - shared_input + self._copies(layer.cached_mlp)
        return 0

    # ---- the whole forward ----
    def per_layer(self) -> list[tuple[str, float]]:
        """``[(name, bytes kept through the forward)]``: embedding output and RoPE's cos/sin, each
        layer (with its weight copies), the final norm and what the head keeps of it (the fused
        loss: nothing)."""
        sh = self.shape
        # A frozen embedding's output needs no gradient, so the first norm keeps none of it.
        embedding = (0 if self.frozen_embeddings else self.w * self.u) + 2 * sh.seq_len * sh.head_dim * self.w
        rows = [("embedding", embedding)]
        rows += [(f"layers.{i}", self.stored_layer_bytes(i)) for i in range(len(self.layers))]
        final_frozen = self.head_trainable == 0  # the final norm's weight forms no gradient (nor the head's)
        if self.fused_head is not None:
            return rows + [("norm", self._norm(self.u, final_frozen))]
        # The head at tp = 1 is a plain Linear: autocast keeps its weight's copy too.
        head_cache = 0 if self.head_split else self._copies(sh.vocab_size * sh.d_model)
        return rows + [("norm", self._norm(self.u, final_frozen) + self._kept_output(self.u, consumers=1) + head_cache)]

    def stored_bytes(self) -> float:
        """Activations kept for the backward at the end of the forward."""
        return sum(b for _, b in self.per_layer())

    def forward_cache_bytes(self) -> float:
        """Weight copies alive in the forward beyond the kept ones: the recomputed parts', held by
        autocast's cache until the forward's autocast exits."""
        mlp_only = self.layout.recompute == "mlp"
        # autocast caches the casts of weights that train only (a frozen one's is freed with its recompute).
        return self._copies(sum(0 if layer.frozen else layer.cached_attention + layer.cached_mlp if self._recomputed(i)
                                else layer.cached_mlp if mlp_only else 0 for i, layer in enumerate(self.layers)))

    def gradient_bytes(self, layer: HFLayer) -> float:
        """Gradients of activations while a layer runs its backward, at their largest (fitted to
        the measured step, not derived op by op): in its MLP's backward the act and up gradients
        and the down projection's weight gradient (none when frozen) at the compute width, or in its norms' two fp32
        gradients of the stream, whichever is larger."""
        width = self.mlp_width(layer)
        weight = 0 if layer.frozen else self.shape.d_model * width
        mlp = (2 * self.t * width * (self.shape.experts_per_token or 1) + weight) * self.c
        return max(mlp, 2 * 4 * self.u)

    def backward_bytes(self, param_bytes: int, persistent_grads: float) -> float:
        """The largest moment of the decoder layers' backward (last layer first): a layer's
        backward holds the activations of the layers below and its own, what it recomputes, the
        parameter gradients formed so far (or those kept between steps) and `gradient_bytes`."""
        rows = [b for _, b in self.per_layer()]
        grads, worst = self.head_trainable * param_bytes, 0.0
        for i in reversed(range(len(self.layers))):
            alive = sum(rows[: i + 2]) + self.recomputed_bytes(i) + self.gradient_bytes(self.layers[i])
            worst = max(worst, alive + max(persistent_grads, grads))
            grads += self.layers[i].trainable * param_bytes
        return worst

    # ---- the loss head ----
    def fused_loss_bytes(self) -> float:
        """In the fused loss's forward, beyond the stored activations: the head's input (the final
        norm's output, which nothing keeps for the backward), the gradients formed there and the
        loss's buffers (`bigdense.plan.fused_head`)."""
        head = self.fused_head.bytes()
        return self.w * self.u + head["grads"] + head["chunk"]

    def logits_elements(self) -> int:
        return self.t * self.shape.vocab_size  # gathered over TP: every rank holds all of them

    def loss_forward_bytes(self) -> float:
        """Inside ``F.cross_entropy``: the logits, their fp32 copy, log-softmax's output."""
        n = self.logits_elements()
        return n * self.c + (4 * n if self.c != 4 else 0) + 4 * n + 8 * self.t

    def loss_backward_bytes(self) -> float:
        """Log-softmax's backward: its saved output, nll's gradient and its own (fp32 each)."""
        return 3 * 4 * self.logits_elements() + 8 * self.t

    def head_backward_bytes(self) -> float:
        """Beyond the stored activations when the output head's backward starts: the gradients the
        fused loss formed in the forward, or the logits' gradient at the compute width."""
        if self.fused_head is not None:
            return self.fused_head.gradient_bytes()
        return self.logits_elements() * self.c

    def tied_gradient_bytes(self, param_bytes: int) -> float:
        """At the end of the backward, with a trained head tied to the embedding: the embedding's
        dense gradient and its sum with the head's, beside the head's (the largest rank's shard)."""
        if not self.shape.tie_embeddings or self.frozen_embeddings:
            return 0
        return 2 * self._local(self.shape.vocab_size, self.head_split) * self.shape.d_model * param_bytes

    # ---- the step ----
    def moments(self, base: float, persistent_grads: float, grads: float, temporaries: float) -> dict[str, float]:
        """Bytes alive at each moment of the step (`bigdense.plan.estimate` says which), given
        ``base`` (parameters, optimizer state, buckets), the gradients kept between steps, all the
        gradients, and the optimizer's temporaries."""
        pb = self.layout.param_bytes
        before = base + persistent_grads + self.stored_bytes()
        if self.fused_head is not None:
            loss = {"forward": before + self.forward_cache_bytes() + self.fused_loss_bytes()}
        else:
            loss = {"forward": before + self.forward_cache_bytes() + self.loss_forward_bytes(),
                    "loss_backward": before + self.loss_backward_bytes()}
        return {
            **loss,
            "backward": base + self.backward_bytes(pb, persistent_grads),
            "backward_end": base + grads + self.tied_gradient_bytes(pb),
            "optimizer": base + grads + temporaries,
        }

    def categories(self) -> dict[str, float]:
        """The activation rows of the memory table."""
        head = self.fused_loss_bytes() if self.fused_head is not None else self.loss_backward_bytes()
        return {"activations": self.stored_bytes(), "head_loss": head,
                "comm_buffers": self.u * self.c if self.tp > 1 else 0}  # the row layers' all-reduce output

    # ---- FLOPs ----
    def _attention_weights(self, layer: HFLayer) -> float:
        """Matmul weights one token meets in ``layer``'s attention on one rank (q, k, v, o)."""
        sh = self.shape
        heads, kv = self._local(sh.n_heads, layer.heads_split), self._local(sh.n_kv_heads, layer.heads_split)
        return sh.d_model * sh.head_dim * (2 * heads + 2 * kv)

    def _mlp_weights(self, layer: HFLayer) -> float:
        """The same in its MLP: the chosen experts, a shared one and the router for an MoE."""
        sh = self.shape
        if layer.mlp == "moe":
            shared = self._local(sh.d_shared_expert, layer.mlp_split)
            return sh.d_model * (3 * sh.experts_per_token * self.mlp_width(layer) + 3 * shared + sh.experts)
        return (3 if layer.mlp == "gated" else 2) * sh.d_model * self.mlp_width(layer)

    def flops_per_micro_batch(self) -> float:
        """Matmul FLOPs of one micro-batch's forward and backward on one TP rank (attention
        scores counted whole, as for the GPT), with the forward recompute repeats."""
        sh, t = self.shape, self.t
        scores = [4 * t * sh.seq_len * self._local(sh.n_heads, layer.heads_split) * sh.head_dim
                  for layer in self.layers]
        mlps = [2 * t * self._mlp_weights(layer) for layer in self.layers]
        fwd = [2 * t * self._attention_weights(layer) + a + m for layer, a, m in zip(self.layers, scores, mlps)]
        head = 2 * t * self._local(sh.vocab_size, self.head_split) * sh.d_model
        if self.layout.recompute == "mlp":
            repeated = sum(mlps)
        else:
            repeated = sum(f for i, f in enumerate(fwd) if self._recomputed(i))
        return 3 * (sum(fwd) + head) + repeated


def _fused_loss(model: CausalLM) -> bool:
    """Whether ``model``'s loss runs through the fused head: its decided path (`CausalLM.loss_path`),
    else what `CausalLM.prepare_loss` decides on the meta device (fused, unless ``fused_loss=False``
    or there is no output head)."""
    if model.loss_path is not None:
        return model.loss_path.fused
    return model.fused_loss and isinstance(getattr(model.lm, "get_output_embeddings", lambda: None)(), nn.Module)


def _softcapped(model: CausalLM) -> bool:
    """Whether ``model``'s logits are softcapped: by the transform its loss path found, or (a path
    not decided, or decided unproved on the meta device) by its config's ``final_logit_softcapping``."""
    found = model.loss_path.transform.softcap if model.loss_path is not None else 0.0
    config = model.text_config()
    return bool(found or getattr(config, "final_logit_softcapping", None))


def is_causal_lm(model: nn.Module) -> bool:
    """A `CausalLM`, or a transformers causal LM (its config names a vocabulary; it has decoder layers)."""
    if isinstance(model, CausalLM):
        return True
    return hasattr(getattr(model, "config", None), "vocab_size") and hasattr(model, "get_input_embeddings") \
        and CausalLM(model).blocks is not None
