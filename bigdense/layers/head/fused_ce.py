"""Vocab-parallel cross-entropy fused with the classifier matmul and chunked over tokens.

Per rank: ``h`` (N, D) replicated on TP, ``weight`` (C_local, D) and ``bias`` (C_local,) this rank's
classes ``[class_start, class_start + C_local)`` of ``num_classes``; ``target`` (N,) replicated.
The logits ``h W^T + b`` exist only one chunk of tokens at a time, (chunk, C_local) per rank, in
forward and backward; no rank ever holds (N, C_local), let alone (N, num_classes).

Per chunk, each rank computes its local softmax statistics -- max ``m_r``, ``s_r = sum exp(z - m_r)``,
the target's logit (0 when the target is another rank's class) and, for label smoothing, the sum of
its logits -- and ONE all-gather of these four numbers per token gives every rank the same
``lse = logsumexp_r(m_r + log s_r)`` and sums, combined locally in rank order, so the loss is
bit-identical on every rank. (The all-reduce formulation needs two rounds, a MAX then a SUM;
the all-gather needs one.) The softmax statistics are fp32 whatever the matmul dtype.

With label smoothing ``eps`` over ``C`` classes, the loss of a token with target ``t`` is
``lse - (1 - eps) z_t - (eps / C) sum_j z_j`` and its logit gradient ``softmax - (1 - eps) onehot_t - eps / C``,
exactly what ``F.cross_entropy(..., label_smoothing=eps)`` computes. With a softcap ``c`` every
logit is ``c * tanh(z / c)`` and its gradient gains the factor ``1 - tanh(z / c)**2``; a z-loss
``zl`` adds ``zl * lse**2`` per counted token and multiplies its softmax term by ``1 + 2 zl lse``
(`bigdense.kernels.softmax_ce` has the formulas, and why the softmax is ``exp((z - M) - log S)``).

Gradient strategy (``strategy=``):

* ``"forward"`` (default for ``reduction="mean"|"sum"``): the loss is a sum of per-token terms with
  weights known in the forward (``1`` or ``1 / n_valid``), and the incoming gradient is one scalar.
  So each chunk's logit gradient is formed while its logits are at hand, and ``grad_h`` (rows of a
  (N, D) buffer) and ``grad_W`` (one (C_local, D) buffer, in-place ``addmm_``) are accumulated right
  there; the backward only multiplies them by the scalar. Three matmuls in all, as for an unfused
  head, and one pass of the softmax.
* ``"recompute"`` (always used for ``reduction="none"``, whose gradient is per token): the forward
  keeps only each token's largest logit and rescaled sum (2N floats, `ce_chunks.ChunkResults`);
  the backward recomputes each chunk's logits: four matmuls.

``python -m bigdense.bench.head --contenders unsharded,bigdense,dtensor,bigdense-recompute`` measures
both strategies (time and peak memory per rank); docs/performance.md records the figures.

``"forward"`` is the default: less time (the fourth matmul and a second softmax pass are gone)
for the same peak memory -- in both, the peak is the weight, its gradient and one or two chunks
of logits; only *when* the gradient buffer appears differs. Its cost is that the gradients exist
from the forward on, and a loss can only be backpropagated once.

The chunks run in one of two loops with the same contract: `ce_chunks` on CPU (and for fp16),
fp32 logits classes-major and fp32 gradients; `ce_gpu` on GPUs (`kernel_path` decides), logits in
the matmul dtype tokens-major, two Triton kernels per chunk, gradients in the operands' dtypes.
Across ranks on GPUs, in both, each chunk's all-gather of statistics is started and left running
while the next chunk's logits are computed (two logits buffers), then finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...host_checks import checks_enabled
from ...parallel import comm, schedule
from ...parallel.autocast import autocast_dtype, no_autocast
from .sampling import SampleRows
from . import ce_chunks, ce_gpu
from .metrics import record
from .ce_chunks import TokenInputs, auto_chunk_size, cast_operands  # noqa: F401 - auto_chunk_size: this module's interface
from .ce_gpu import kernel_chunk_tokens, kernel_path

@dataclass(frozen=True)
class CEConfig:
    """Everything but the tensors. ``group`` is the TP group (``None``: one rank)."""

    group: Optional[comm.ProcessGroup]
    num_classes: int
    class_start: int
    label_smoothing: float
    ignore_index: int
    reduction: str  # "mean" | "sum" | "none"
    chunk_size: int
    strategy: str  # "forward" | "recompute"
    compute_dtype: torch.dtype  # the matmul dtype: autocast's, else the input's
    grad_wanted: bool = True  # False under no_grad / for frozen inputs: no gradient work at all
    sum_grad_h: bool = True  # False: hand back this rank's partial grad_h (the caller reduces it)
    # The group ``grad_h`` is summed over (the ranks sharing these tokens); ``group`` when None.
    grad_group: Optional[comm.ProcessGroup] = None
    rows: Optional["RowBlocks"] = None  # the tokens are every DP rank's, gathered (classes split over DP too)
    sample: Optional[SampleRows] = None  # the classes are a sample padded to a static capacity
    # GPU path (`ce_gpu`): accumulate the weight gradient in fp32 whatever the weight's dtype.
    fp32_weight_grad: bool = False
    softcap: float = 0.0  # the logits the loss sees are softcap * tanh(z / softcap) (0: z itself)
    z_loss: float = 0.0  # coefficient of lse**2 added to each counted token's loss

    @property
    def smoothing_classes(self):
        """The classes label smoothing spreads over: ``num_classes`` (a sample's count, a device
        scalar), at least 1 (a sample of no class: every token is ignored then, targets are always
        scored)."""
        if self.sample is not None:
            return self.sample.total.clamp(min=1.0)
        return max(self.num_classes, 1)

    @property
    def h_group(self):
        return self.group if self.grad_group is None else self.grad_group


@dataclass(frozen=True)
class RowBlocks:
    """The tokens are the concatenation of every DP rank's tokens, ``sizes`` rows each in rank order,
    and this rank's are the first ``count`` rows of block ``rank`` (the rest, with checks off, are
    padding with ignored targets). The loss is then this rank's own (the mean over its own tokens),
    ``h``'s gradient that loss's, and the weight's gradient the DP average of every rank's loss
    gradient -- what data-parallel averaging makes of a head split over TP only.

    ``factors`` (ranks,) or None: the factor each rank's caller will scale its loss by
    (`metrics.loss_factor`: the engines' token weighting). The weight's gradient, formed in the
    forward, then weighs each block by it, and the backward divides each rank's incoming gradient
    by it again -- what remains is common to every rank, as that gradient needs."""

    group: Optional[comm.ProcessGroup]
    sizes: tuple[int, ...]
    rank: int
    count: int
    factors: Optional[torch.Tensor] = None

    @property
    def own(self) -> slice:
        start = sum(self.sizes[: self.rank])
        return slice(start, start + self.count)

    def block_of_rows(self, device) -> torch.Tensor:
        """The DP rank whose block each row is in, (N,). Built on the host and copied without a
        wait (``repeat_interleave`` on the device would read its output size there)."""
        blocks = torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes),
                                         output_size=sum(self.sizes))
        return blocks.to(device, non_blocking=True)


class FusedVocabParallelCE(torch.autograd.Function):
    """Cross-entropy of ``h @ weight.T + bias`` over classes sharded on ``cfg.group``, fused and chunked.

    ``target_offset`` (N,) fp32 or None: added to each token's target logit (a margin); its
    gradient is returned like the others'. With ``cfg.rows`` the tokens are every DP rank's and the
    result is this rank's block's (see `RowBlocks`).

    forward collectives: one all-gather of (4, chunk) fp32 statistics per chunk over ``cfg.group``;
    with the ``"forward"`` strategy and ``h`` requiring grad, one all-reduce (sum) of ``grad_h``
    (N, D) over ``cfg.h_group``. backward collectives: ``"forward"``: none; ``"recompute"``: one
    all-reduce of ``grad_h``; with ``cfg.rows``, one all-gather of the incoming gradient over DP.
    With ``cfg.sum_grad_h`` off, ``grad_h`` is this rank's partial sum and no all-reduce runs.
    Returns the loss (fp32, the z-loss included): a scalar, or (N,) for ``reduction="none"``; and,
    not differentiable, the call's counts over the tokens of the result, (3,) fp32 in the order of
    `metrics.METRICS`: tokens counted, of them predicted right (the target's logit is the
    largest), the sum of their z-loss terms.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, target_offset, cfg: CEConfig):
        # The matmul dtype was decided by the caller (autocast's, if on); inside, every op is explicit.
        with no_autocast(h.device.type):
            loss, metrics = _forward(ctx, h, weight, bias, target, target_offset, cfg)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_out, _grad_metrics):
        with no_autocast(grad_out.device.type):
            return _backward(ctx, grad_out)


def _forward(ctx, h, weight, bias, target, target_offset, cfg: CEConfig):
    need_h, need_w, need_b, _, need_off = ctx.needs_input_grad[:5]
    need_off = need_off and target_offset is not None
    grads_now = cfg.grad_wanted and cfg.strategy == "forward" and (need_h or need_w or need_b or need_off)
    n_tokens, c_local = h.shape[0], weight.shape[0]

    valid = target != cfg.ignore_index
    # Labels out of range reach here only with host checks off: their loss and weight become NaN.
    bad = valid & ((target < 0) | (target >= cfg.num_classes))
    if cfg.sample is not None:  # a sample larger than its capacity: NaN on every rank, the step is skipped
        bad = bad | (valid & cfg.sample.overflow)
    t_local = target - cfg.class_start
    in_shard = valid & (t_local >= 0) & (t_local < c_local)
    t_local = torch.where(in_shard, t_local, 0)
    token_weight, count = _token_weights(valid, cfg)
    token_weight = token_weight.masked_fill(bad, float("nan"))
    offset = None if target_offset is None else torch.where(in_shard, target_offset.float(), 0.0)
    real = None if cfg.sample is None else cfg.sample.real

    hc_all, wc, bc = cast_operands(h, weight, bias, cfg.compute_dtype)
    tokens = TokenInputs(t_local, in_shard, offset, real, token_weight, valid)
    wanted = (need_h, need_w, need_b) if grads_now else (False, False, False)
    loop = ce_gpu if kernel_path(h.device.type, cfg.compute_dtype) else ce_chunks
    out = loop.forward_chunks(hc_all, wc, bc, weight.dtype, tokens, wanted, cfg)
    grad_h, grad_w, grad_b = out.grads

    grad_offset = _target_offset_grad(out.z_target, (out.shift, out.total), token_weight, cfg) if need_off else None
    if grads_now:
        if grad_h is not None and n_tokens and cfg.sum_grad_h:
            comm.all_reduce_(grad_h, cfg.h_group)
        ctx.grads = (grad_h, grad_w, grad_b, grad_offset)
    else:
        ctx.grads = None
        ctx.save_for_backward(h, weight, bias, target, offset)
        ctx.softmax, ctx.t_local, ctx.in_shard, ctx.token_weight = (out.shift, out.total), t_local, in_shard, token_weight
        ctx.z_target = out.z_target if need_off else None
    ctx.cfg = cfg
    ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype,
                  None if target_offset is None else target_offset.dtype)

    z_terms = torch.where(valid, cfg.z_loss * out.lse.square(), 0.0) if cfg.z_loss else None
    losses = out.losses if z_terms is None else out.losses + z_terms
    losses = losses.masked_fill(bad, float("nan"))
    own = slice(None) if cfg.rows is None else cfg.rows.own
    metrics = torch.stack([valid[own].sum().float(), out.correct[own].sum().float(),
                           z_terms[own].sum() if z_terms is not None else losses.new_zeros(())])
    losses = losses[own]
    if cfg.reduction == "none":
        return losses, metrics
    total = losses.sum()
    return (total / count if cfg.reduction == "mean" else total), metrics


REDUCTIONS = ("mean", "sum", "none")
STRATEGIES = ("forward", "recompute")


def check_logit_options(prefix: str, softcap=None, z_loss=None) -> tuple[float, float]:
    """``(softcap, z_loss)`` as floats (None: 0, off), each a finite number >= 0, else a ValueError
    naming the option after ``prefix`` (a layer's ``"Name(...): "``, or a config group's ``"model."``)."""
    out = []
    for name, value in (("softcap", softcap), ("z_loss", z_loss)):
        value = 0.0 if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < float("inf"):
            raise ValueError(f"{prefix}{name} must be a finite number >= 0 (0 or None: off), got {value!r}")
        out.append(float(value))
    return out[0], out[1]


def fused_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor, *,
                        group, num_classes: int, class_start: int, largest_shard: int, where: str,
                        label_smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
                        softcap: float = 0.0, z_loss: float = 0.0, chunk_size: Optional[int] = None,
                        strategy: str = "forward", sum_grad_h: bool = True, fp32_weight_grad: bool = False,
                        target_offset: Optional[torch.Tensor] = None, rows: Optional["RowBlocks"] = None,
                        sample: Optional[SampleRows] = None, grad_group=None) -> torch.Tensor:
    """``F.cross_entropy(cap(h W^T + b), target, ...)`` (+ the z-loss) with the classes split over
    ``group``: this rank's ``weight`` (C_local, D) and ``bias`` hold classes ``[class_start,
    class_start + C_local)`` of ``num_classes``; ``h`` (N, D) and ``target`` (N,) the same on every
    rank of ``group``; ``largest_shard`` the most classes any rank holds (every rank cuts the tokens
    at the same places). Checks the options (errors name ``where``: the layer), builds the call's
    `CEConfig`, runs `FusedVocabParallelCE` and hands its counts to `metrics.record`. The matmuls
    run in autocast's dtype when it is on."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {label_smoothing}")
    softcap, z_loss = check_logit_options(f"{where}: ", softcap, z_loss)
    device_type = h.device.type
    compute_dtype = autocast_dtype(device_type, h.dtype)
    cfg = CEConfig(
        group=group, num_classes=num_classes, class_start=class_start, label_smoothing=float(label_smoothing),
        ignore_index=int(ignore_index), reduction=reduction,
        chunk_size=chunk_size or loss_chunk_tokens(largest_shard, device_type, compute_dtype, comm.group_size(group),
                                                   softcap=bool(softcap)),
        strategy="recompute" if reduction == "none" else strategy, compute_dtype=compute_dtype,
        # Decided here: inside the autograd function grad mode is always off and needs_input_grad
        # says True even under no_grad, so evaluation would form gradients.
        grad_wanted=torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, weight, bias, target_offset)),
        sum_grad_h=sum_grad_h, grad_group=grad_group, rows=rows, sample=sample,
        fp32_weight_grad=fp32_weight_grad, softcap=softcap, z_loss=z_loss,
    )
    loss, metrics = schedule.tag(FusedVocabParallelCE.apply(h, weight, bias, target, target_offset, cfg))
    record(metrics)
    return loss


def loss_chunk_tokens(max_local_classes: int, device_type: str, compute_dtype: torch.dtype, group_size: int,
                      softcap: bool = False) -> int:
    """Tokens per chunk of the fused loss, by the path that will run it (every rank the same). With a
    softcap the CPU loop keeps a second fp32 buffer per chunk (tanh, for the gradient): half the tokens."""
    if kernel_path(device_type, compute_dtype):
        return kernel_chunk_tokens(max_local_classes, compute_dtype.itemsize, group_size)
    return auto_chunk_size(max_local_classes * (2 if softcap else 1), device_type)


def _target_offset_grad(z_target, softmax, token_weight, cfg: CEConfig) -> torch.Tensor:
    """d loss / d target_offset per token: the target's softmax (times ``1 + 2 zl lse`` with a
    z-loss) minus its label weight, times the token's weight (the same on every rank: it needs only
    the combined statistics, ``softmax = (M, S)``)."""
    eps = cfg.label_smoothing
    softmax = ce_chunks.softmax_scale(z_target, *softmax, cfg.z_loss)
    grad = token_weight * (softmax - (1.0 - eps) - eps / cfg.smoothing_classes)
    # A token that does not count has no gradient, also where its softmax is undefined (a sample of
    # no class: lse = -inf); a bad label's NaN weight (checks off) still poisons the step, as documented.
    return torch.where(token_weight != 0, grad, 0.0)


def _token_weights(valid: torch.Tensor, cfg: CEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d loss_i per token, this rank's count of counted tokens): the count stays a tensor.

    With row blocks each block is weighted by its own count, as its rank's loss is."""
    if cfg.rows is None:
        count = valid.sum().clamp(min=1).float()
        return (valid.float() / count if cfg.reduction == "mean" else valid.float()), count
    block = cfg.rows.block_of_rows(valid.device)
    counts = torch.zeros(len(cfg.rows.sizes), device=valid.device).index_add_(0, block, valid.float()).clamp(min=1)
    weight = valid.float() / counts[block] if cfg.reduction == "mean" else valid.float()
    if cfg.rows.factors is not None:
        weight = weight * cfg.rows.factors[block]
    return weight, counts[cfg.rows.rank]


def _incoming_per_token(ctx, grad_out) -> torch.Tensor:
    """The incoming gradient as a per-token factor: a scalar, or with row blocks the factor of every
    DP rank's tokens (each rank's gradient is for its own block: one all-gather over DP)."""
    rows = ctx.cfg.rows
    if rows is None:
        return grad_out.float()
    g = grad_out.float().reshape(-1)
    # Decided by the reduction, the same on every rank -- never by this rank's size: under
    # reduction="none" a rank holding one token also sends one gradient per token.
    scalar = ctx.cfg.reduction != "none"
    sizes = [1] * len(rows.sizes) if scalar else list(rows.sizes)
    if not scalar and rows.count < rows.sizes[rows.rank]:  # padding rows: no gradient
        g = torch.cat([g, g.new_zeros(rows.sizes[rows.rank] - rows.count)])
    every = comm.all_gather_dim(g.contiguous(), 0, rows.group, sizes)
    every = every[rows.block_of_rows(g.device)] if scalar else every
    # The forward weighed each block by its rank's loss factor already (`RowBlocks`).
    return every if rows.factors is None else every / rows.factors[rows.block_of_rows(g.device)]


def _backward(ctx, grad_out):
    cfg = ctx.cfg
    if cfg.strategy == "forward" and cfg.reduction != "none":
        if ctx.grads is None:
            raise RuntimeError(
                "ParallelClassifierHead.loss: backward ran twice through one loss (retain_graph=True?). "
                "With strategy='forward' the gradients are formed in the forward and handed over once; "
                "use strategy='recompute' to backward more than once."
            )
        (grad_h, grad_w, grad_b, grad_off), ctx.grads = ctx.grads, None
        per_token = _incoming_per_token(ctx, grad_out)
        shared = grad_out.float() if cfg.rows is None else _one_factor(per_token, cfg.rows) / len(cfg.rows.sizes)
        # In place: these buffers are ours alone, and a second copy of grad_W would cost its size.
        grads = (
            None if grad_h is None else grad_h.mul_(per_token.unsqueeze(-1) if per_token.dim() else per_token),
            None if grad_w is None else grad_w.mul_(shared),
            None if grad_b is None else grad_b.mul_(shared),
            None if grad_off is None else grad_off.mul_(per_token),
        )
        grads = _cast_grads(grads, ctx.dtypes)
        return grads[0], grads[1], grads[2], None, grads[3], None
    return _recompute_backward(ctx, grad_out)


def _one_factor(per_token: torch.Tensor, rows: "RowBlocks") -> torch.Tensor:
    """The one incoming factor every DP rank passed; the weight gradient, a sum over every rank's
    tokens formed in the forward, can only be scaled by one. Different factors raise with checks on
    and make the weight gradient NaN with checks off (nothing is read on the host then)."""
    if not per_token.numel():
        return per_token.new_ones(())
    same = (per_token == per_token[0]).all()
    if checks_enabled() and not bool(same):
        raise RuntimeError(
            "ParallelClassifierHead.loss (shard='world', grad_strategy='forward'): the DP ranks "
            "backpropagated different factors into their losses; the weight gradient was formed in the forward "
            "for one common factor. Use grad_strategy='recompute' for per-rank loss weights."
        )
    return torch.where(same, per_token[0], float("nan"))


def _cast_grads(grads, dtypes):
    return tuple(None if g is None else g.to(dt) for g, dt in zip(grads, dtypes))


def _recompute_backward(ctx, grad_out):
    cfg = ctx.cfg
    h, weight, bias, target, offset = ctx.saved_tensors
    need_h, need_w, need_b, _, need_off = ctx.needs_input_grad[:5]
    n_tokens = h.shape[0]
    # Per-token weight of d(loss)/d(loss_i), times the incoming gradient (a scalar or one per token).
    token_weight = ctx.token_weight * _incoming_per_token(ctx, grad_out)
    hc_all, wc, bc = cast_operands(h, weight, bias, cfg.compute_dtype)
    real = None if cfg.sample is None else cfg.sample.real
    tokens = TokenInputs(ctx.t_local, ctx.in_shard, offset, real, token_weight, None)
    loop = ce_gpu if kernel_path(h.device.type, cfg.compute_dtype) else ce_chunks
    grad_h, grad_w, grad_b = loop.recompute_chunks(hc_all, wc, bc, weight.dtype, tokens, *ctx.softmax,
                                                   (need_h, need_w, need_b), cfg)
    if grad_h is not None and n_tokens and cfg.sum_grad_h:
        comm.all_reduce_(grad_h, cfg.h_group)
    if cfg.rows is not None:  # the weight's gradient is the DP average of every rank's loss gradient
        for g in (grad_w, grad_b):
            if g is not None:
                g.div_(len(cfg.rows.sizes))
    grad_off = None
    if need_off and offset is not None:
        grad_off = _target_offset_grad(ctx.z_target, ctx.softmax, token_weight, cfg)
    grads = _cast_grads((grad_h, grad_w, grad_b, grad_off), ctx.dtypes)
    return grads[0], grads[1], grads[2], None, grads[3], None

