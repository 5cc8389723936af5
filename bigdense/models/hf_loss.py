"""A Hugging Face causal LM's loss through bigdense's fused vocab-parallel cross-entropy.

A transformers causal LM computes ``logits = f(lm_head(h))`` over the whole vocabulary, where ``f``
is the architecture's own transform between the head and the logits: Gemma's
``final_logit_softcapping`` (``c * tanh(z / c)``), Cohere's ``logit_scale`` (``z * s``), Granite's
``logits_scaling`` (``z / s``), Muse's multiplier and softcap, Inkling's vocabulary slice
(``z[..., :unpadded_vocab_size]``), none at all for most. `CausalLM` skips the logits instead:

* `HeadTap` stands in for the output head's forward while a loss is computed: it keeps the hidden
  states the head is given and returns an empty ``(..., 0)`` tensor, so the model's own forward
  (whatever it does to the hidden states before its head, and to the logits after) runs without a
  (tokens x vocabulary) tensor, and the head's matmul never runs;
* `find_transform` learns ``f`` from the model itself, not from config names: the tap hands the
  model's forward a row of known logits spanning nine orders of magnitude and reads what comes
  out; ``f`` must be ``cap(a * z)`` on the first ``keep`` classes, with a scalar ``a > 0``, a
  softcap ``cap`` or none, and ``keep`` the whole vocabulary or fewer (`LogitTransform`);
* `prove` then runs a probe batch both ways -- the model's own logits and ``F.cross_entropy``,
  and the fused loss of the tapped hidden states -- and compares the loss and its gradients with
  respect to the hidden states and the head's weight (and bias).

Only a transform found and proved is used (`LossPath`); otherwise the model keeps the gathered
path (its logits, gathered over TP, and ``F.cross_entropy``), and the path's ``reason`` says why.
The head's weight is this rank's shard of the vocabulary (`head_shard`: a column-split head, or a
whole one), tied to the input embedding or not, with its bias where it has one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers.head.fused_ce import fused_cross_entropy
from ..parallel.sharding import shard_spec_of

# The probe logits' magnitudes: small enough that any softcap is linear there (its slope reads the
# scale), large enough that any softcap saturates (its ceiling reads the cap).
_PROBE_MAGNITUDES = (1e-3, 3e-3, 0.1, 0.7, 2.0, 9.0, 40.0, 300.0, 1e4, 1e6)
_FIT_RTOL = 1e-5  # fp32 ops on exact inputs: a few ulps
PROOF_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}  # else (bf16, fp16 weights): 3e-2
PROBE_SHAPE = (2, 8)


@dataclass(frozen=True)
class LogitTransform:
    """``logits = cap(scale * z)[..., :keep]`` for the head's output ``z``: ``softcap`` ``c`` (0: none)
    makes ``cap(x) = c * tanh(x / c)``; ``keep`` (None: every class) the classes scored."""

    scale: float = 1.0
    softcap: float = 0.0
    keep: Optional[int] = None

    def describe(self) -> str:
        parts = ([f"logits x {self.scale:g}"] if self.scale != 1.0 else []) + (
            [f"softcap {self.softcap:g}"] if self.softcap else []) + (
            [f"the first {self.keep} classes"] if self.keep is not None else [])
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class LossPath:
    """How a `CausalLM` computes its loss: ``fused`` (with ``transform``) or gathered, and why."""

    fused: bool
    transform: LogitTransform = LogitTransform()
    reason: str = ""

    def describe(self) -> str:
        if self.fused:
            return f"fused (logit transform: {self.transform.describe()})"
        return f"gathered logits: {self.reason}"


class HeadTap:
    """The output head's forward, replaced on the instance (its class, parameters and names stay).
    While `run` has a ``hook`` in place, the head's forward calls ``hook(h)`` on the hidden states it
    is given and returns, in place of the logits: a row the hook returns (stand-in logits of the
    whole vocabulary), expanded to ``h``'s leading dims; for a 0-dim tensor the hook returns (a
    loss), an empty ``(..., 0)`` view of it; for None, an empty tensor. Its own forward (the matmul)
    does not run. Otherwise the head's own forward runs.

    The hook runs inside the head's forward, so whatever wraps that forward sees the hook's use of
    the head's parameters as the head's own: FSDP gathers the head's shards for it. And the empty
    view of a loss keeps the head's output on the loss's autograd path (`CausalLM` adds its sum,
    0, to the loss), so what FSDP hooks onto a module's outputs -- gathering the shards again
    before the module's backward -- runs before the loss's backward, as for any module."""

    def __init__(self, head: nn.Module):
        self.head = head
        self.hook = None
        head.forward = self._forward

    def _forward(self, h, *args, **kwargs):
        if self.hook is None:
            return type(self.head).forward(self.head, h, *args, **kwargs)
        out = self.hook(h)
        if out is None:
            return h.new_empty(*h.shape[:-1], 0)
        if out.dim() == 0:
            return out.reshape((1,) * h.dim()).narrow(-1, 0, 0).expand(*h.shape[:-1], 0)
        return out.to(h.device).expand(*h.shape[:-1], -1)

    def run(self, lm: nn.Module, x: torch.Tensor, hook):
        """``lm(input_ids=x).logits`` with ``hook`` in place of the head's matmul."""
        self.hook = hook
        try:
            return lm(input_ids=x, use_cache=False).logits
        finally:
            self.hook = None


@dataclass(frozen=True)
class HeadShard:
    """This rank's rows of the output head: ``weight`` (C_local, D), ``bias`` or None, classes
    ``[class_start, class_start + C_local)`` of ``num_classes`` split over ``group`` (None: whole),
    ``largest`` the most any rank holds."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    group: object
    class_start: int
    num_classes: int
    largest: int


def head_shard(head: nn.Module) -> HeadShard:
    """The output head's shard of the vocabulary; a ValueError says why a head has none the fused
    loss can use."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"its output head ({type(head).__name__}) has no 2-D weight")
    spec = shard_spec_of(weight)
    if spec is None:
        return HeadShard(weight, bias, None, 0, weight.shape[0], weight.shape[0])
    if spec.dim == 1:
        raise ValueError(f"its output head is split along its input features ({list(spec.sizes)} of "
                         f"{spec.global_shape[1]} per rank), not by vocabulary rows: its logits are partial sums "
                         f"over TP, whole only once added")
    if spec.dim != 0 or spec.parts != 1 or spec.group != "tp":
        raise ValueError(f"its output head's weight is split as {spec}, not by vocabulary rows over TP")
    return HeadShard(weight, bias, head.tp_group, spec.start, spec.global_shape[0], max(spec.sizes))


def fused_loss(h: torch.Tensor, y: torch.Tensor, shard: HeadShard, transform: LogitTransform, *, where: str,
               z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of ``transform(h W^T + b)`` against ``y`` (-100 ignored), fused: ``h`` (*,
    D) the hidden states the head was given, the same on every rank of ``shard.group``. A scale
    multiplies ``h`` and the bias (the same product); a slice keeps this rank's rows below
    ``keep``."""
    weight, bias, num_classes = shard.weight, shard.bias, shard.num_classes
    if transform.keep is not None:
        rows = max(0, min(weight.shape[0], transform.keep - shard.class_start))
        weight, bias, num_classes = weight[:rows], None if bias is None else bias[:rows], transform.keep
    h = h.reshape(-1, h.shape[-1])
    if transform.scale != 1.0:
        h, bias = h * transform.scale, None if bias is None else bias * transform.scale
    return fused_cross_entropy(h, weight, bias, y.reshape(-1), group=shard.group, num_classes=num_classes,
                               class_start=shard.class_start, largest_shard=shard.largest, where=where,
                               softcap=transform.softcap, z_loss=z_loss, reduction=reduction)


def probe_ids(vocab_size: int, device) -> torch.Tensor:
    """A fixed batch of token ids (its own generator: no random stream of the run is drawn)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=g).to(device)


def _probe_row(vocab: int) -> torch.Tensor:
    """(vocab,) fp32 logits: ``_PROBE_MAGNITUDES`` in turn, alternating in sign, each a little
    different (distinct values)."""
    j = torch.arange(vocab, dtype=torch.float64)
    magnitude = torch.tensor(_PROBE_MAGNITUDES, dtype=torch.float64)[j.long() % len(_PROBE_MAGNITUDES)]
    sign = 1.0 - 2.0 * ((j.long() // len(_PROBE_MAGNITUDES)) % 2)
    return (sign * magnitude * (1.0 + 1e-3 * (j % 7))).float()


def find_transform(lm: nn.Module, tap: HeadTap, vocab: int, ids: torch.Tensor) -> LogitTransform:
    """What ``lm``'s forward does to its head's output (see the module docstring); a ValueError says
    why it is none of the forms `LogitTransform` describes."""
    row = _probe_row(vocab)
    with torch.no_grad():
        out = tap.run(lm, ids, lambda h: row)
    keep = out.shape[-1]
    if out.shape[:-1] != ids.shape or keep > vocab or keep == 0:
        raise ValueError(f"its forward turns (..., {vocab}) head outputs into logits of shape {tuple(out.shape)}")
    got = out.reshape(-1, keep).double()
    if not torch.equal(got, got[:1].expand_as(got)):
        raise ValueError("its logits depend on the token, not on the head's output alone")
    z, f = row[:keep].double(), got[0]
    small = z.abs() < 1e-2
    scale = float((f[small] / z[small]).median()) if small.any() else float("nan")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"its logits are not an increasing function of the head's output (slope {scale})")
    if _close(f, z * scale):
        return LogitTransform(scale=scale, keep=keep if keep < vocab else None)
    cap = float(f.abs().max())
    if _close(f, cap * torch.tanh(z * scale / cap)):
        return LogitTransform(scale=scale, softcap=cap, keep=keep if keep < vocab else None)
    raise ValueError("its logits go through a transform that is neither a scale nor a softcap of the head's output")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got, want, rtol=_FIT_RTOL, atol=_FIT_RTOL * float(want.abs().max()) * 1e-6))


def prove(lm: nn.Module, tap: HeadTap, transform: LogitTransform, ids: torch.Tensor, where: str) -> Optional[str]:
    """None when, on the probe batch ``ids`` (next-token targets), the fused loss and its gradients
    with respect to the hidden states and the head's weight (and bias) equal the model's own logits
    path's; else what differs. A frozen head (low-rank adapters train the rest) is proved by the
    loss and the hidden states' gradient; a model with nothing trained before its head, by the
    head's. Parameters' ``.grad`` are left as they were."""
    y = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    head = tap.head
    params = {"the head weight's gradient": head.weight, "the head bias' gradient": getattr(head, "bias", None)}
    params = {name: p for name, p in params.items() if p is not None and p.requires_grad}
    wrt = list(params.values())
    hidden = []
    hook = head.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
    try:
        logits = lm(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    own = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    through_hidden = hidden[0].requires_grad
    want = torch.autograd.grad(own, [hidden[0]] * through_hidden + wrt) if own.requires_grad else ()
    fused = []
    tap.run(lm, ids, lambda h: fused.append((h, fused_loss(h, y, head_shard(head), transform, where=where))))
    (h, ours), = fused
    got = torch.autograd.grad(ours, [h] * through_hidden + wrt) if ours.requires_grad else ()
    rtol = PROOF_RTOL.get(head.weight.dtype, 3e-2)
    names = ["loss"] + ["the hidden states' gradient"] * through_hidden + list(params)
    for name, a, b in zip(names, [ours, *got], [own, *want]):
        err = float((a.detach().float() - b.detach().float()).abs().max()) / max(float(b.detach().float().abs().max()), 1e-30)
        if not err <= rtol:
            return f"on a probe batch, {name} of the fused loss is {err:.1e} (relative) from the model's own, above {rtol:g}"
    return None
