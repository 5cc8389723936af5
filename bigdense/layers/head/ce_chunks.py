"""The fused vocab-parallel cross-entropy's CPU loop (also fp16's on GPUs): the per-chunk work, the
buffers it reuses, and the loops themselves (`forward_chunks`, `recompute_chunks`; the GPU loop in
`ce_gpu` has the same two, with the same arguments).

`ChunkBuffers` holds everything of chunk size or larger that the loss needs, allocated once per
call and reused by every chunk: the fp32 logits (two slots on GPUs, where one chunk's collective
overlaps the next chunk's matmul: `logits_slots`), the low-precision matmul output of an autocast
(bf16/fp16) run, and a block of weight-gradient rows. So a bf16 call allocates nothing per chunk,
and the fp32 weight gradient is accumulated block by block, never through a temporary of the
weight's size.

Chunk sizes are per device (`auto_chunk_size`): the largest number of tokens whose fp32 logits fit
in one slot of `AUTO_CHUNK_BYTES`. On CPU a multiple of 16 and never fewer than `CPU_MIN_TOKENS`: a
chunk's three matmuls are (classes x d) by (d x tokens) products, which MKL runs about 10% slower at
64 tokens than at a few hundred and about 2x slower at 8 (``python -m bigdense.bench.head_floor
--chunk-gemms 8 64 256``). Cutting the classes into cache-sized tiles as well was measured and does
not win that back: the cost is the GEMMs' thin token dimension, not where the logits sit. On GPUs
a multiple of 128 tokens (the tile of tensor-core GEMMs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...kernels.softmax_ce import MAX, SMOOTH, STATS, SUM, TARGET, combined_stats, correct_tokens
from ...parallel import comm

AUTO_CHUNK_BYTES = {"cpu": 128 * 2**20, "default": 512 * 2**20}  # fp32 logits of one chunk (one slot)
CPU_MIN_TOKENS = 64
GPU_TOKEN_MULTIPLE = 128
WEIGHT_GRAD_BLOCK_BYTES = 16 * 2**20  # rows of the weight gradient formed at once in low precision
# The lowest shifted logit the softmax exponentiates. Below it exp(x) leaves fp32's normal range
# (2**-126 is exp(-87.3)), and this CPU's exp takes a slow path: 55 ns per element for -100 and 6 ns
# for -inf (a sample's padding), against 1.5 ns. Raising such terms to exp(-87) = 1.6e-38 changes no
# sum that holds the maximum's exp(0) = 1, and a gradient entry by less than 1.6e-38 (padding rows'
# gradients are masked out where the sample's rows are gathered).
EXP_FLOOR = -87.0
CPU_TOKEN_MULTIPLE = 16  # chunks of a multiple of the vector width: a column reduction over 1,342
# tokens ran at 2.7 ns per element, over 1,344 at 0.85


@dataclass(frozen=True)
class TokenInputs:
    """What either chunk loop reads per token, formed once per call by `fused_ce`: ``t_local`` (N,)
    the target's index among this rank's classes (0 off-shard), ``in_shard`` (N,) whether this rank
    holds it (and the token counts), ``offset`` (N,) fp32 or None, added to the target's logit (a
    margin; 0 off-shard), ``real`` (C_local,) bool or None, a sample's real rows, ``weight`` (N,)
    fp32 d loss / d loss_i, ``valid`` (N,) the tokens that count (None in the recompute backward)."""

    t_local: torch.Tensor
    in_shard: torch.Tensor
    offset: Optional[torch.Tensor]
    real: Optional[torch.Tensor]
    weight: torch.Tensor
    valid: Optional[torch.Tensor]


@dataclass(frozen=True)
class ChunkResults:
    """What either loop's forward hands back, per token (N,) fp32 unless said: ``losses`` the
    cross-entropy before weighting (0 for a token that does not count), ``shift`` and ``total`` the
    softmax's ``M`` and ``S`` (`softmax_ce.combined_stats`: ``lse = M + log S``, the softmax
    ``exp((z - M) - log S)``), ``z_target`` the target's logit (None without a margin), ``correct``
    (N,) bool the target's logit is the largest, ``grads`` ``(grad_h, grad_w, grad_b)`` (None
    where not formed)."""

    losses: torch.Tensor
    shift: torch.Tensor
    total: torch.Tensor
    z_target: Optional[torch.Tensor]
    correct: torch.Tensor
    grads: tuple

    @property
    def lse(self) -> torch.Tensor:
        return self.shift + self.total.log()


def token_losses(shift, total, z_target, z_sum, eps: float, smoothing_classes) -> torch.Tensor:
    """The cross-entropy of each token from the combined statistics: ``lse - (1 - eps) z_t - (eps /
    C) sum_j z_j``, written ``(M - z_t) + log S`` without smoothing, so that at large logits no fp32
    ``lse`` is rounded before the difference is taken."""
    if eps == 0:
        return (shift - z_target) + total.log()
    return (shift - (1.0 - eps) * z_target - (eps / smoothing_classes) * z_sum) + total.log()


def grad_buffers(hc_all: torch.Tensor, wc: torch.Tensor, wanted, grad_h_dtype: torch.dtype,
                 grad_w_dtype: torch.dtype):
    """(grad_h, grad_w, grad_b) where ``wanted`` (None elsewhere): grad_h uninitialised (each chunk
    writes its rows), grad_w zeroed, grad_b zeroed in fp32."""
    need_h, need_w, need_b = wanted
    return (torch.empty(hc_all.shape, dtype=grad_h_dtype, device=hc_all.device) if need_h else None,
            torch.zeros(wc.shape, dtype=grad_w_dtype, device=wc.device) if need_w else None,
            torch.zeros(wc.shape[0], dtype=torch.float32, device=wc.device) if need_b else None)


def logits_slots(group_size: int, device_type: str) -> int:
    """fp32 logits slots of one call: 2 on GPUs with more than one rank (a chunk's all-gather of
    statistics runs under the next chunk's matmul); 1 on CPU, where that collective takes
    microseconds next to the chunk's seconds of matmul, and the memory buys a chunk twice as thick."""
    return 2 if group_size > 1 and device_type != "cpu" else 1


def auto_chunk_size(max_local_classes: int, device_type: str = "cpu") -> int:
    """Tokens per chunk for a rank group whose largest shard has ``max_local_classes`` classes (the
    same on every rank: every chunk is one collective, so boundaries must agree)."""
    budget = AUTO_CHUNK_BYTES.get(device_type, AUTO_CHUNK_BYTES["default"])
    tokens = max(1, budget // (4 * max(1, max_local_classes)))
    if device_type == "cpu":
        return max(CPU_MIN_TOKENS, tokens // CPU_TOKEN_MULTIPLE * CPU_TOKEN_MULTIPLE)
    return max(GPU_TOKEN_MULTIPLE, tokens // GPU_TOKEN_MULTIPLE * GPU_TOKEN_MULTIPLE)


def exp_shifted_(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``z := exp(max(z - shift, EXP_FLOOR))`` per token (``z`` classes-major). A ``shift`` of -inf (a
    token whose classes here are all padding) is replaced by the lowest float; the caller gives such
    a token a softmax scale of 0."""
    z.sub_(shift.clamp(min=torch.finfo(z.dtype).min))
    return z.clamp_(min=EXP_FLOOR).exp_()


class ChunkBuffers:
    """Reused buffers of one call for ``wc`` (C_local, D) and chunks of up to ``chunk`` tokens."""

    def __init__(self, wc: torch.Tensor, n_tokens: int, chunk: int, slots: int, weight_grad: bool,
                 softcap: float = 0.0):
        self.c_local, width = wc.shape
        self.chunk = max(1, min(chunk, n_tokens))
        size = self.c_local * self.chunk
        self.fp32 = [torch.empty(size, dtype=torch.float32, device=wc.device) for _ in range(slots)]
        # With a softcap, each slot's tanh(z / c), kept for the gradient's factor 1 - tanh**2.
        self.softcap = float(softcap or 0.0)
        self.tanh = [torch.empty(size, dtype=torch.float32, device=wc.device) for _ in range(slots if softcap else 0)]
        self.low = None if wc.dtype == torch.float32 else torch.empty(size, dtype=wc.dtype, device=wc.device)
        self.block_rows = max(1, WEIGHT_GRAD_BLOCK_BYTES // max(1, width * wc.element_size()))
        self.block = None
        if weight_grad and self.low is not None:
            self.block = torch.empty(min(self.block_rows, self.c_local), width, dtype=wc.dtype, device=wc.device)

    def logits(self, hc, wc, bc, slot: int) -> torch.Tensor:
        """fp32 logits of one chunk, classes-major (C_local, n), computed in the operands' dtype (as
        autocast would). Classes-major because ``W h^T`` and the weight gradient ``zt @ h`` are the
        faster GEMM layouts for these shapes on CPU (MKL) than ``h W^T`` and ``z^T @ h``; reductions
        over classes become column reductions, equally cheap. Into the reused buffers: a fresh
        multi-MiB block per chunk pays its page faults every time."""
        shape = (self.c_local, hc.shape[0])
        out = self.fp32[slot][: shape[0] * shape[1]].view(shape)
        target = out if self.low is None else self.low[: shape[0] * shape[1]].view(shape)
        if bc is None:
            torch.mm(wc, hc.t(), out=target)
        else:
            torch.addmm(bc.unsqueeze(1), wc, hc.t(), out=target)
        if self.low is not None:
            out.copy_(target)
        if self.softcap:  # z := c * tanh(z / c), tanh(z / c) kept in this slot's second buffer
            tanh = self.tanh[slot][: shape[0] * shape[1]].view(shape)
            torch.tanh(out.div_(self.softcap), out=tanh)
            torch.mul(tanh, self.softcap, out=out)
        return out

    def cap_slope(self, slot: int, zt: torch.Tensor) -> Optional[torch.Tensor]:
        """``1 - tanh(z / c)**2`` of slot ``slot``'s chunk (shaped like its logits ``zt``), d
        cap(z) / d z, formed in place of the kept tanh; None without a softcap."""
        if not self.softcap:
            return None
        tanh = self.tanh[slot][: zt.numel()].view(zt.shape)
        return tanh.mul_(tanh).neg_().add_(1.0)

    def low_copy(self, pt: torch.Tensor) -> torch.Tensor:
        """``pt`` in the matmul dtype, in the low-precision buffer (free once a chunk's logits are fp32)."""
        return self.low[: pt.numel()].view(pt.shape).copy_(pt)


def chunk_stats(zt: torch.Tensor, t_local: torch.Tensor, in_shard: torch.Tensor, smoothing: bool,
                real: Optional[torch.Tensor] = None):
    """Local softmax statistics of fp32 logits ``zt`` (C_local, n), classes-major; leaves
    ``exp(z - m_local)`` in ``zt`` (floored, `exp_shifted_`). ``real`` (C_local,) bool: the rows that
    are classes, the others padding of a sample (logit -inf). A token whose rows here are all
    padding has a max of -inf, which `combine` and the caller's softmax scale treat as none.

    Returns (`softmax_ce.STATS`, n), the rows `softmax_ce.row_stats` writes: max, sum of exp(z -
    max), target logit (0 off-shard), sum of logits (0 unless smoothing).
    """
    n = zt.shape[1]
    stats = zt.new_zeros(STATS, n)
    if zt.shape[0] == 0:  # a rank with no classes (num_classes < tp) contributes exp(-inf) = 0
        stats[MAX].fill_(float("-inf"))
        return stats
    stats[MAX] = zt.amax(dim=0)
    stats[TARGET] = torch.where(in_shard, zt.gather(0, t_local.unsqueeze(0)).squeeze(0), 0.0)
    if smoothing:
        stats[SMOOTH] = (zt if real is None else torch.where(real.unsqueeze(1), zt, 0.0)).sum(dim=0)
    stats[SUM] = exp_shifted_(zt, stats[MAX]).sum(dim=0)
    return stats


def start_combine(local: torch.Tensor, group) -> comm.Pending:
    """Start gathering every rank's (`STATS`, n) statistics; `combine` reads what arrives. In
    between, the caller may compute the next chunk's logits, so the collective overlaps that matmul."""
    return comm.all_gather_dim_start(local, 0, group, [STATS] * comm.group_size(group))


def combine(started: comm.Pending) -> torch.Tensor:
    """Every rank's statistics of a chunk, (R, `STATS`, n) in rank order (the same on every rank)."""
    every = started.wait()
    return every.view(-1, STATS, every.shape[-1])


def add_at_target_(zt: torch.Tensor, t_local: torch.Tensor, offset: torch.Tensor) -> None:
    """Add ``offset`` (n,) to each token's target logit in ``zt`` (C_local, n); 0 off-shard."""
    if zt.shape[0]:
        zt.scatter_add_(0, t_local.unsqueeze(0), offset.unsqueeze(0))


def logit_grad_(pt: torch.Tensor, scale, t_local, in_shard, weight, eps: float, num_classes: int) -> torch.Tensor:
    """Turn ``pt * scale`` (C_local, n, fp32; softmax probabilities once scaled) into
    ``weight[i] * dloss_i/dz`` in place: one pass over the chunk for both factors."""
    pt.mul_(scale * weight)
    if pt.shape[0] == 0:
        return pt
    if eps > 0:
        pt.sub_(weight * (eps / num_classes))
    pt.scatter_add_(0, t_local.unsqueeze(0), (-(1.0 - eps) * weight * in_shard).unsqueeze(0))
    return pt


def chunk_grads(pt, scale, t_local, in_shard, weight, hc, wc, rows: slice, grads, bufs: ChunkBuffers,
                eps: float, num_classes: int, slope: Optional[torch.Tensor] = None) -> None:
    """Add one chunk's gradients into the fp32 buffers ``grads = (grad_h, grad_w, grad_b)``.

    ``pt * scale`` (C_local, n, fp32) are the chunk's softmax probabilities; ``weight`` (n,) the
    per-token factor d(loss)/d(loss_i). In fp32 without label smoothing the factors go onto the
    (n, D) operands and results and ``pt`` is left as it is (`_fp32_grads_unscaled`); with smoothing
    they are folded into the logit gradient, which every class's entry then needs anyway. In a
    lower-precision matmul dtype it is not: a factor such as 1/n_valid would push small per-logit
    gradients below fp16's smallest normal number, flushing them to zero. There the matmuls see the
    unweighted logit gradient (entries in [-1, 1]) and the factor is applied in fp32 afterwards: per
    row for ``grad_h``, and for ``grad_w`` (a sum over tokens) as the chunk's largest factor times
    each token's factor relative to it; ``grad_w`` is then formed ``bufs.block_rows`` rows at a time.
    ``slope`` (C_local, n) or None: d cap(z) / d z of a softcap, multiplying the logit gradient.
    """
    grad_h, grad_w, grad_b = grads
    if wc.dtype == torch.float32 and eps == 0 and slope is None:
        _fp32_grads_unscaled(pt, scale * weight, -weight * in_shard, t_local, hc, wc, rows, grads)
        return
    if wc.dtype == torch.float32:
        logit_grad_(pt, scale, t_local, in_shard, weight, eps, num_classes)
        if slope is not None:
            pt.mul_(slope)
        if grad_b is not None:
            grad_b.add_(pt.sum(1))
        if grad_h is not None:
            torch.mm(pt.t(), wc, out=grad_h[rows])
        if grad_w is not None:
            grad_w.addmm_(pt, hc)
        return
    logit_grad_(pt, scale, t_local, in_shard, (weight != 0).float(), eps, num_classes)
    if slope is not None:
        pt.mul_(slope)
    if grad_b is not None:
        grad_b.addmv_(pt, weight)
    low = bufs.low_copy(pt)
    if grad_h is not None:
        grad_h[rows] = torch.mm(low.t(), wc).float().mul_(weight.unsqueeze(1))
    if grad_w is not None:
        largest = weight.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)  # NaN stays NaN
        scaled_h = hc * (weight / largest).to(hc.dtype).unsqueeze(1)
        for r0 in range(0, low.shape[0], bufs.block_rows):
            r1 = min(r0 + bufs.block_rows, low.shape[0])
            block = torch.mm(low[r0:r1], scaled_h, out=bufs.block[: r1 - r0])
            grad_w[r0:r1].addcmul_(block, largest)


def _fp32_grads_unscaled(pt, factor, at_target, t_local, hc, wc, rows: slice, grads) -> None:
    """`chunk_grads` in fp32 without label smoothing, leaving ``pt`` as it is: the logit gradient is
    ``pt * factor`` (a factor per token, a column of ``pt``) plus ``at_target`` (n,) at each token's
    target row, so the factor goes onto the (n, D) operands and results, and the target term is a
    gather or scatter of n rows. That saves a read and a write of the whole (C_local, n) chunk."""
    grad_h, grad_w, grad_b = grads
    if pt.shape[0] == 0:  # no class on this rank: nothing to add, and no target row to index
        if grad_h is not None:
            grad_h[rows] = 0.0
        return
    if grad_b is not None:
        grad_b.addmv_(pt, factor).index_add_(0, t_local, at_target)
    if grad_h is not None:
        out = torch.mm(pt.t(), wc, out=grad_h[rows]).mul_(factor.unsqueeze(1))
        out.addcmul_(wc.index_select(0, t_local), at_target.unsqueeze(1))
    if grad_w is not None:
        grad_w.addmm_(pt, hc * factor.unsqueeze(1))
        grad_w.index_add_(0, t_local, hc * at_target.unsqueeze(1))


def cast_operands(h, weight, bias, dtype) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Operands in the matmul dtype, cast once per call rather than once per chunk."""
    return h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def softmax_scale(local_max: torch.Tensor, shift: torch.Tensor, total: torch.Tensor, z_loss: float) -> torch.Tensor:
    """Per token, what turns this rank's ``exp(z - m_local)`` into the loss's softmax term:
    ``exp((m_local - M) - log S)``, times ``1 + 2 zl lse`` with a z-loss. 0 where this rank scores no
    class (a sample's padding only), also when no rank does (S = 0: every token is ignored)."""
    log_total = torch.where(total != 0, total, 1.0).log()
    scale = torch.where(local_max == float("-inf"), 0.0, torch.exp((local_max - shift) - log_total))
    return scale if not z_loss else scale * (1.0 + 2.0 * z_loss * (shift + log_total))


def forward_chunks(hc_all, wc, bc, weight_dtype, tokens: TokenInputs, wanted, cfg) -> ChunkResults:
    """Every chunk of the forward on this loop (`fused_ce` says when it runs): the call's
    `ChunkResults`, with the fp32 ``(grad_h, grad_w, grad_b)`` where ``wanted`` (``weight_dtype`` is
    unused: this loop's gradients are fp32, cast by the caller). ``cfg`` is the call's
    `fused_ce.CEConfig`."""
    n_tokens = hc_all.shape[0]
    t_local, in_shard, offset, real = tokens.t_local, tokens.in_shard, tokens.offset, tokens.real
    token_weight, valid = tokens.weight, tokens.valid
    need_h, need_w, need_b = wanted
    smoothing = cfg.label_smoothing > 0
    slots = logits_slots(comm.group_size(cfg.group), hc_all.device.type)
    bufs = ChunkBuffers(wc, n_tokens, cfg.chunk_size, slots, need_w, cfg.softcap)
    shift, total, z_target, z_sum = torch.zeros(4, n_tokens, dtype=torch.float32, device=wc.device)
    correct = torch.zeros(n_tokens, dtype=torch.bool, device=wc.device)
    grads = grad_buffers(hc_all, wc, wanted, torch.float32, torch.float32)
    grads_now = need_h or need_w or need_b

    def finish(rows: slice, slot: int, zt, stats, started) -> None:
        """Everything of a chunk that needs the other ranks' statistics."""
        every = combine(started)
        shift[rows], total[rows] = combined_stats(every)
        z_target[rows], z_sum[rows] = every[:, TARGET].sum(0), every[:, SMOOTH].sum(0)
        correct[rows] = correct_tokens(every)
        if grads_now:
            scale = softmax_scale(stats[MAX], shift[rows], total[rows], cfg.z_loss)
            chunk_grads(zt, scale, t_local[rows], in_shard[rows], token_weight[rows], hc_all[rows], wc, rows, grads,
                        bufs, cfg.label_smoothing, cfg.smoothing_classes, bufs.cap_slope(slot, zt))

    pending = None
    for index, lo in enumerate(range(0, n_tokens, cfg.chunk_size)):
        rows, slot = slice(lo, min(lo + cfg.chunk_size, n_tokens)), index % len(bufs.fp32)
        zt = bufs.logits(hc_all[rows], wc, bc, slot)
        if offset is not None:
            add_at_target_(zt, t_local[rows], offset[rows])
        stats = chunk_stats(zt, t_local[rows], in_shard[rows], smoothing, real)  # z := exp(z - m_local)
        started = start_combine(stats, cfg.group)
        if pending is not None:  # the previous chunk's statistics arrived while this chunk's matmul ran
            finish(*pending)
        pending = (rows, slot, zt, stats, started)
        if slots == 1:  # the next chunk would overwrite the only slot
            finish(*pending)
            pending = None
    if pending is not None:
        finish(*pending)
    losses = token_losses(shift, total, z_target, z_sum, cfg.label_smoothing, cfg.smoothing_classes)
    losses = torch.where(valid, losses, 0.0)
    return ChunkResults(losses, shift, total, z_target if offset is not None else None, correct & valid, grads)


def recompute_chunks(hc_all, wc, bc, weight_dtype, tokens: TokenInputs, shift, total, wanted, cfg):
    """The recompute strategy's backward on this loop: each chunk's logits again, its gradient from
    the forward's softmax ``shift`` and ``total`` (`ChunkResults`); the fp32 ``(grad_h, grad_w,
    grad_b)`` where ``wanted``."""
    n_tokens = hc_all.shape[0]
    bufs = ChunkBuffers(wc, n_tokens, cfg.chunk_size, 1, wanted[1], cfg.softcap)
    grads = grad_buffers(hc_all, wc, wanted, torch.float32, torch.float32)
    for lo in range(0, n_tokens, cfg.chunk_size):
        rows = slice(lo, min(lo + cfg.chunk_size, n_tokens))
        p = bufs.logits(hc_all[rows], wc, bc, 0)
        if tokens.offset is not None:
            add_at_target_(p, tokens.t_local[rows], tokens.offset[rows])
        # (S = 0 only where no rank scores a class, so every token is ignored: its weight is 0)
        exp_shifted_(p, shift[rows])
        scale = softmax_scale(shift[rows], shift[rows], total[rows], cfg.z_loss)
        chunk_grads(p, scale, tokens.t_local[rows], tokens.in_shard[rows], tokens.weight[rows], hc_all[rows], wc,
                    rows, grads, bufs, cfg.label_smoothing, cfg.smoothing_classes, bufs.cap_slope(0, p))
    return grads
