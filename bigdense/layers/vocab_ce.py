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
exactly what ``F.cross_entropy(..., label_smoothing=eps)`` computes.

Gradient strategy (``strategy=``):

* ``"forward"`` (default for ``reduction="mean"|"sum"``): the loss is a sum of per-token terms with
  weights known in the forward (``1`` or ``1 / n_valid``), and the incoming gradient is one scalar.
  So each chunk's logit gradient is formed while its logits are at hand, and ``grad_h`` (rows of a
  (N, D) buffer) and ``grad_W`` (one (C_local, D) buffer, in-place ``addmm_``) are accumulated right
  there; the backward only multiplies them by the scalar. Three matmuls in all, as for an unfused
  head, and one pass of the softmax.
* ``"recompute"`` (always used for ``reduction="none"``, whose gradient is per token): the forward
  keeps only ``lse`` (N floats); the backward recomputes each chunk's logits: four matmuls.

``python -m bigdense.bench.head --contenders unsharded,bigdense,dtensor,bigdense-recompute`` measures
both strategies (time and peak memory per rank); the README records the figures.

``"forward"`` is the default: less time (the fourth matmul and a second softmax pass are gone)
for the same peak memory -- in both, the peak is the weight, its gradient and one chunk of
logits; only *when* the gradient buffer appears differs. Its cost is that the gradients exist
from the forward on, and a loss can only be backpropagated once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..parallel import comm

# The chunk size when none is given: the largest number of tokens whose fp32 logits fit in this
# many bytes on the rank with the most classes (the same on every rank: chunk boundaries must
# agree, since every chunk is one collective).
AUTO_CHUNK_BYTES = 64 * 2**20


def auto_chunk_size(max_local_classes: int) -> int:
    return max(1, AUTO_CHUNK_BYTES // (4 * max(1, max_local_classes)))


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


def _chunk_stats(zt: torch.Tensor, t_local: torch.Tensor, in_shard: torch.Tensor, smoothing: bool):
    """Local softmax statistics of fp32 logits ``zt`` (C_local, n), classes-major; leaves
    ``exp(z - m_local)`` in ``zt``.

    Returns (4, n): max, sum of exp(z - max), target logit (0 off-shard), sum of logits (0 unless
    smoothing).
    """
    n = zt.shape[1]
    stats = zt.new_zeros(4, n)
    if zt.shape[0] == 0:  # a rank with no classes (num_classes < tp) contributes exp(-inf) = 0
        stats[0].fill_(float("-inf"))
        return stats
    stats[0] = zt.amax(dim=0)
    stats[2] = torch.where(in_shard, zt.gather(0, t_local.unsqueeze(0)).squeeze(0), 0.0)
    if smoothing:
        stats[3] = zt.sum(dim=0)
    zt.sub_(stats[0]).exp_()
    stats[1] = zt.sum(dim=0)
    return stats


def _combine(local: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, target logit, sum of logits) per token from every rank's (4, n) statistics."""
    world = comm.group_size(group)
    every = comm.all_gather_dim(local, 0, group, [4] * world).view(world, 4, -1)
    # log(0) = -inf for a rank without classes; logsumexp ignores it.
    lse = torch.logsumexp(every[:, 0] + every[:, 1].log(), dim=0)
    return lse, every[:, 2].sum(0), every[:, 3].sum(0)


def _logit_grad_(pt: torch.Tensor, scale: torch.Tensor, t_local, in_shard, weight, cfg: CEConfig) -> torch.Tensor:
    """Turn ``pt * scale`` (C_local, n, fp32; softmax probabilities once scaled) into
    ``weight[i] * dloss_i/dz`` in place: one pass over the chunk for both factors."""
    eps = cfg.label_smoothing
    pt.mul_(scale * weight)
    if pt.shape[0] == 0:
        return pt
    if eps > 0:
        pt.sub_(weight * (eps / cfg.num_classes))
    pt.scatter_add_(0, t_local.unsqueeze(0), (-(1.0 - eps) * weight * in_shard).unsqueeze(0))
    return pt


class FusedVocabParallelCE(torch.autograd.Function):
    """Cross-entropy of ``h @ weight.T + bias`` over classes sharded on TP, fused and chunked.

    forward collectives: one all-gather of (4, chunk) fp32 statistics per chunk; with the
    ``"forward"`` strategy and ``h`` requiring grad, one all-reduce (sum) of ``grad_h`` (N, D).
    backward collectives: ``"forward"``: none; ``"recompute"``: one all-reduce of ``grad_h``.
    With ``cfg.sum_grad_h`` off, ``grad_h`` is this rank's partial sum and no all-reduce runs.
    Returns the loss (fp32): a scalar, or (N,) for ``reduction="none"``.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, target, cfg: CEConfig):
        # The matmul dtype was decided by the caller (autocast's, if on); inside, every op is explicit.
        with _no_autocast(h.device.type):
            return _forward(ctx, h, weight, bias, target, cfg)

    @staticmethod
    def backward(ctx, grad_out):
        with _no_autocast(grad_out.device.type):
            return _backward(ctx, grad_out)


def _no_autocast(device_type: str):
    # The meta device (shape-only runs, op counting) has no autocast state.
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)


def _forward(ctx, h, weight, bias, target, cfg: CEConfig):
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grads_now = cfg.grad_wanted and cfg.strategy == "forward" and (need_h or need_w or need_b)
    n_tokens, c_local = h.shape[0], weight.shape[0]
    smoothing = cfg.label_smoothing > 0

    valid = target != cfg.ignore_index
    # Labels out of range reach here only with host checks off: their loss and weight become NaN.
    bad = valid & ((target < 0) | (target >= cfg.num_classes))
    t_local = target - cfg.class_start
    in_shard = valid & (t_local >= 0) & (t_local < c_local)
    t_local = torch.where(in_shard, t_local, 0)
    count = valid.sum().clamp(min=1).float()  # a tensor: no host synchronisation
    token_weight = valid.float() / count if cfg.reduction == "mean" else valid.float()
    token_weight = token_weight.masked_fill(bad, float("nan"))

    hc_all, wc, bc = _cast(h, weight, bias, cfg.compute_dtype)
    buffer = _logits_buffer(n_tokens, wc, cfg)
    losses = torch.zeros(n_tokens, dtype=torch.float32, device=h.device)
    lse_all = torch.empty(n_tokens, dtype=torch.float32, device=h.device)
    if grads_now:
        grad_h = torch.empty(n_tokens, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        grad_b = torch.zeros(c_local, dtype=torch.float32, device=h.device) if need_b else None

    for lo in range(0, n_tokens, cfg.chunk_size):
        hi = min(lo + cfg.chunk_size, n_tokens)
        hc = hc_all[lo:hi]
        zt = _logits(hc, wc, bc, buffer)
        stats = _chunk_stats(zt, t_local[lo:hi], in_shard[lo:hi], smoothing)  # z := exp(z - m_local)
        lse, z_target, z_sum = _combine(stats, cfg.group)
        lse_all[lo:hi] = lse
        loss = lse - (1.0 - cfg.label_smoothing) * z_target
        if smoothing:
            loss = loss - (cfg.label_smoothing / cfg.num_classes) * z_sum
        losses[lo:hi] = torch.where(valid[lo:hi], loss, 0.0)
        if grads_now:
            # exp(z - m_local) * exp(m_local - lse) is the softmax.
            _chunk_grads(zt, torch.exp(stats[0] - lse), t_local[lo:hi], in_shard[lo:hi], token_weight[lo:hi],
                         hc, wc, lo, hi, (grad_h, grad_w, grad_b), cfg)
        del zt  # one chunk's logits live at a time (in `buffer`, or freed before the next is made)

    if grads_now:
        if grad_h is not None and n_tokens and cfg.sum_grad_h:
            comm.all_reduce_(grad_h, cfg.group)
        ctx.grads = (grad_h, grad_w, grad_b)
    else:
        ctx.grads = None
        ctx.save_for_backward(h, weight, bias, target)
        ctx.lse, ctx.t_local, ctx.in_shard, ctx.token_weight = lse_all, t_local, in_shard, token_weight
    ctx.cfg, ctx.dtypes = cfg, (h.dtype, weight.dtype, None if bias is None else bias.dtype)

    losses = losses.masked_fill(bad, float("nan"))
    if cfg.reduction == "none":
        return losses
    total = losses.sum()
    return total / count if cfg.reduction == "mean" else total


def _backward(ctx, grad_out):
    cfg = ctx.cfg
    if cfg.strategy == "forward" and cfg.reduction != "none":
        if ctx.grads is None:
            raise RuntimeError(
                "ParallelClassifierHead.loss: backward ran twice through one loss (retain_graph=True?). "
                "With strategy='forward' the gradients are formed in the forward and handed over once; "
                "use strategy='recompute' to backward more than once."
            )
        grads, ctx.grads = ctx.grads, None
        # In place: these buffers are ours alone, and a second copy of grad_W would cost its size.
        out = [None if g is None else g.mul_(grad_out).to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return out[0], out[1], out[2], None, None
    return _recompute_backward(ctx, grad_out)


def _recompute_backward(ctx, grad_out):
    cfg = ctx.cfg
    h, weight, bias, target = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    n_tokens = h.shape[0]
    # Per-token weight of d(loss)/d(loss_i), times the incoming gradient (a scalar or one per token).
    token_weight = ctx.token_weight * grad_out.float()
    hc_all, wc, bc = _cast(h, weight, bias, cfg.compute_dtype)
    buffer = _logits_buffer(n_tokens, wc, cfg)
    grad_h = torch.empty(n_tokens, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if need_b else None
    for lo in range(0, n_tokens, cfg.chunk_size):
        hi = min(lo + cfg.chunk_size, n_tokens)
        hc = hc_all[lo:hi]
        p = _logits(hc, wc, bc, buffer).sub_(ctx.lse[lo:hi]).exp_()
        _chunk_grads(p, 1.0, ctx.t_local[lo:hi], ctx.in_shard[lo:hi], token_weight[lo:hi],
                     hc, wc, lo, hi, (grad_h, grad_w, grad_b), cfg)
        del p  # before the next chunk's logits exist
    if grad_h is not None and n_tokens and cfg.sum_grad_h:
        comm.all_reduce_(grad_h, cfg.group)
    h_dt, w_dt, b_dt = ctx.dtypes
    return (
        None if grad_h is None else grad_h.to(h_dt),
        None if grad_w is None else grad_w.to(w_dt),
        None if grad_b is None else grad_b.to(b_dt),
        None,
        None,
    )


def _cast(h, weight, bias, dtype):
    """Operands in the matmul dtype, cast once per call rather than once per chunk."""
    return h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _logits(hc, wc, bc, buffer: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 logits of one chunk, classes-major: (C_local, n), computed in the operands' dtype (as
    autocast would). Classes-major because ``W h^T`` and the weight gradient ``zt @ h`` are the
    faster GEMM layouts for these shapes on CPU (MKL) than ``h W^T`` and ``z^T @ h``; reductions
    over classes become column reductions, equally cheap. fp32 logits land in ``buffer`` (one
    allocation per call, reused by every chunk: a fresh multi-MiB block per chunk pays its page
    faults every time)."""
    shape = (wc.shape[0], hc.shape[0])
    if wc.dtype == torch.float32 and buffer is not None:
        out = buffer[: shape[0] * shape[1]].view(shape)
        return torch.mm(wc, hc.t(), out=out) if bc is None else torch.addmm(bc.unsqueeze(1), wc, hc.t(), out=out)
    zt = torch.mm(wc, hc.t()) if bc is None else torch.addmm(bc.unsqueeze(1), wc, hc.t())
    return zt if zt.dtype == torch.float32 else zt.float()


def _logits_buffer(n_tokens: int, wc: torch.Tensor, cfg: CEConfig) -> Optional[torch.Tensor]:
    if wc.dtype != torch.float32 or n_tokens == 0:
        return None
    return torch.empty(wc.shape[0] * min(cfg.chunk_size, n_tokens), dtype=torch.float32, device=wc.device)


def _chunk_grads(pt, scale, t_local, in_shard, weight, hc, wc, lo, hi, grads, cfg: CEConfig) -> None:
    """Add one chunk's gradients into the fp32 buffers ``grads = (grad_h, grad_w, grad_b)``.

    ``pt * scale`` (C_local, n, fp32) are the chunk's softmax probabilities; ``weight`` (n,) the
    per-token factor d(loss)/d(loss_i) (1/n_valid for a mean, times the incoming gradient in the
    backward). In fp32 the factor is folded into the logit gradient. In a lower-precision matmul
    dtype it is not: a factor such as 1/n_valid would push small per-logit gradients below fp16's
    smallest normal number before the loss scale is applied, flushing them to zero. There the
    matmuls see the unweighted logit gradient (entries in [-1, 1]) and the factor is applied in
    fp32 afterwards: per row for ``grad_h``, and for ``grad_w`` (a sum over tokens) as the chunk's
    largest factor times each token's factor relative to it (exactly 0 or 1 for "mean"/"sum").
    """
    grad_h, grad_w, grad_b = grads
    dtype = cfg.compute_dtype
    if dtype == torch.float32:
        _logit_grad_(pt, scale, t_local, in_shard, weight, cfg)
        if grad_b is not None:
            grad_b.add_(pt.sum(1))
        if grad_h is not None:
            torch.mm(pt.t(), wc, out=grad_h[lo:hi])
        if grad_w is not None:
            grad_w.addmm_(pt, hc)
        return
    _logit_grad_(pt, scale, t_local, in_shard, (weight != 0).float(), cfg)
    if grad_b is not None:
        grad_b.add_(pt @ weight)
    low = pt.to(dtype)
    if grad_h is not None:
        grad_h[lo:hi] = torch.mm(low.t(), wc).float().mul_(weight.unsqueeze(1))
    if grad_w is not None:
        largest = weight.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)  # NaN stays NaN
        relative = (weight / largest).to(dtype).unsqueeze(1)
        grad_w.add_(torch.mm(low, hc * relative).float().mul_(largest))
