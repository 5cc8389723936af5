"""The fused cross-entropy's chunk loop on GPUs: three GEMMs and two fused passes per chunk.

`fused_ce` runs this loop where `kernel_path` says so (CUDA tensors in bf16 or fp32), the loop of
`ce_chunks` elsewhere (the CPU path, and the reference these kernels are tested against). Per chunk
of ``n`` tokens, with this rank's ``C`` classes:

1. ``z = h W^T (+ b)``: one GEMM straight into a (n, C) buffer in the matmul dtype, tokens-major;
2. `row_stats` (one kernel): each token's max, sum of exponentials, target logit and smoothing sum,
   in fp32; the (4, n) statistics are all-gathered over the class group exactly as on the CPU path
   (started here, finished after the next chunk's GEMM when two buffers allow);
3. `softmax_grad_` (one kernel): ``lse`` from every rank's statistics, and the token-weighted
   softmax gradient written over ``z`` (target, label smoothing, margins, ignored tokens, a sample's
   padding all inside it);
4. ``grad_h[rows] = dz W`` and ``grad_W += dz^T h``: one GEMM each, into their buffers.

No pass casts, copies or accumulates beside them: 2 bytes read per logit for the statistics, 4 read
and written for the gradient in bf16. The per-token losses are formed once per call from the
gathered statistics. The weight gradient is in the weight's dtype (bf16 weights: bf16 gradients,
whose per-chunk accumulation rounds to bf16 once per chunk), or fp32 with ``fp32_weight_grad``
(twice the gradient's memory, and twice its GEMM-epilogue traffic per chunk, then one cast).

fp16 keeps the CPU-shaped path: its loop scales the gradient in fp32 after the GEMMs, which an fp16
logit gradient scaled by 1/tokens would otherwise flush to zero.

``python -m bigdense.bench.head --gpu-proxy`` counts this loop's launches, bytes and peak on the
``meta`` device; ``python -m bigdense.bench.gpu --peers`` times it on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...kernels import ce_kernels
from ...kernels.softmax_ce import SMOOTH, STATS, TARGET, combined_stats, correct_tokens, kernels_choice
from ...parallel import comm
from .ce_chunks import ChunkResults, TokenInputs, grad_buffers, token_losses

# The logits buffers of one call (every slot), in the matmul dtype. With the bf16 gradients this
# keeps the call's peak (weight and input gradients included) near 1.25 GiB at 128k-256k classes.
KERNEL_LOGITS_BYTES = 160 * 2**20
KERNEL_TOKEN_MULTIPLE = 64  # chunks of whole GEMM tiles


def kernel_path(device_type: str, compute_dtype: torch.dtype) -> bool:
    """Whether the fused loss runs this module's loop: off the CPU (CUDA, and ``meta``, whose trace
    is the GPU's control flow), or anywhere when `KERNELS_ENV` names an implementation; never in
    fp16, nor with `KERNELS_ENV` ``off``."""
    chosen = kernels_choice()
    if compute_dtype == torch.float16 or chosen == "off":
        return False
    return device_type != "cpu" or chosen is not None


def kernel_slots(group_size: int) -> int:
    """Logits buffers of one call: two where a chunk's all-gather of statistics runs under the next
    chunk's GEMM (more than one rank), else one."""
    return 2 if group_size > 1 else 1


def kernel_chunk_tokens(max_local_classes: int, itemsize: int, group_size: int) -> int:
    """Tokens per chunk: the most whose logits fill `KERNEL_LOGITS_BYTES` over the call's buffers, a
    multiple of `KERNEL_TOKEN_MULTIPLE` (at least one)."""
    per_token = max(1, max_local_classes) * itemsize * kernel_slots(group_size)
    tokens = KERNEL_LOGITS_BYTES // per_token
    return max(KERNEL_TOKEN_MULTIPLE, tokens // KERNEL_TOKEN_MULTIPLE * KERNEL_TOKEN_MULTIPLE)


@dataclass(frozen=True)
class TokenTerms:
    """What the kernels read per token and per class, formed once per call.

    ``target`` (N,) the local class index, -1 off-shard or ignored; ``offset`` (N,) fp32 or None,
    added to the target's logit; ``real`` (C,) bool or None, a sample's real rows; ``weight`` (N,)
    fp32, d loss / d loss_i; ``smooth`` a device scalar eps / classes, or None; ``softcap`` and
    ``z_loss`` the call's logit options (0: off)."""

    target: torch.Tensor
    offset: Optional[torch.Tensor]
    real: Optional[torch.Tensor]
    weight: torch.Tensor
    eps: float
    smooth: Optional[torch.Tensor]
    softcap: float = 0.0
    z_loss: float = 0.0

    def stats_(self, kernels, z: torch.Tensor, rows: slice, smoothing: bool, out: torch.Tensor) -> torch.Tensor:
        offset = None if self.offset is None else self.offset[rows]
        return kernels.row_stats(z, self.target[rows], offset, self.real, smoothing, out, softcap=self.softcap)

    def grad_(self, kernels, z: torch.Tensor, stats: torch.Tensor, rows: slice) -> torch.Tensor:
        offset = None if self.offset is None else self.offset[rows]
        return kernels.softmax_grad_(z, stats, self.target[rows], offset, self.real, self.weight[rows],
                                     self.eps, self.smooth, softcap=self.softcap, z_loss=self.z_loss)


def token_terms(tokens: TokenInputs, cfg) -> TokenTerms:
    """The kernels' view of ``tokens`` under the call's `fused_ce.CEConfig`: off-shard targets as -1,
    eps / classes on the device."""
    eps, smooth = cfg.label_smoothing, None
    if eps > 0:
        smooth = (torch.full((), eps, device=tokens.weight.device) / cfg.smoothing_classes).float()
    target = torch.where(tokens.in_shard, tokens.t_local, -1)
    return TokenTerms(target, tokens.offset, tokens.real, tokens.weight, eps, smooth, cfg.softcap, cfg.z_loss)


def _logits(hc: torch.Tensor, wc: torch.Tensor, bc: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    if bc is None:
        return torch.mm(hc, wc.t(), out=out)
    return torch.addmm(bc, hc, wc.t(), out=out)


def _accumulate_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in one GEMM; an fp32 ``out`` of low-precision operands through the GEMM's
    fp32 output (CUDA, meta). CPU tensors (tests forcing this path) upcast the operands instead."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    elif out.device.type == "cpu":
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)


def chunk_grads(dz: torch.Tensor, hc: torch.Tensor, wc: torch.Tensor, rows: slice, grads) -> None:
    """Add one chunk's gradients: ``dz`` (n, C) the logit gradient, ``grads = (grad_h, grad_w,
    grad_b)`` (None where not wanted); rows ``rows`` of ``grad_h`` are this chunk's own."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        torch.mm(dz, wc, out=grad_h[rows])
    if grad_w is not None:
        _accumulate_mm_(grad_w, dz.t(), hc)
    if grad_b is not None:
        grad_b.add_(dz.sum(dim=0, dtype=grad_b.dtype))


class KernelChunks:
    """The reused buffers and the chunk boundaries of one call: ``slots`` logits buffers of
    ``chunk`` tokens, and the (4, N) local statistics laid out chunk after chunk (each chunk's
    (4, n) contiguous, as the all-gather sends it)."""

    def __init__(self, hc_all: torch.Tensor, wc: torch.Tensor, chunk: int, slots: int):
        self.n_tokens, self.c_local = hc_all.shape[0], wc.shape[0]
        self.chunk = max(1, min(chunk, self.n_tokens))
        self.buffers = [wc.new_empty(self.chunk * self.c_local) for _ in range(slots)]
        self.kernels = ce_kernels(hc_all.device)

    def ranges(self):
        for index, lo in enumerate(range(0, self.n_tokens, self.chunk)):
            yield index, slice(lo, min(lo + self.chunk, self.n_tokens))

    def logits(self, hc, wc, bc, index: int) -> torch.Tensor:
        buffer = self.buffers[index % len(self.buffers)]
        return _logits(hc, wc, bc, buffer[: hc.shape[0] * self.c_local].view(hc.shape[0], self.c_local))


def _forward_loop(hc_all, wc, bc, terms: TokenTerms, smoothing: bool, group, chunk: int, grads) -> torch.Tensor:
    """Every chunk of the forward: statistics, and with ``grads`` not all None the gradients too.
    Returns every rank's statistics of every token, (R, `STATS`, N) fp32 in rank order."""
    ranks = comm.group_size(group)
    loop = KernelChunks(hc_all, wc, chunk, kernel_slots(ranks))
    local = torch.empty(STATS * loop.n_tokens, dtype=torch.float32, device=hc_all.device)
    gathered, pending = [], None
    wants_grads = any(g is not None for g in grads)

    def finish(rows: slice, z: torch.Tensor, started: comm.Pending) -> None:
        every = started.wait().view(ranks, STATS, z.shape[0])
        gathered.append(every)
        if wants_grads:
            chunk_grads(terms.grad_(loop.kernels, z, every, rows), hc_all[rows], wc, rows, grads)

    for index, rows in loop.ranges():
        z = loop.logits(hc_all[rows], wc, bc, index)
        stats = terms.stats_(loop.kernels, z, rows, smoothing,
                             local[STATS * rows.start: STATS * rows.stop].view(STATS, z.shape[0]))
        started = comm.all_gather_dim_start(stats, 0, group, [STATS] * ranks)
        if pending is not None:  # the previous chunk's statistics arrived while this chunk's GEMM ran
            finish(*pending)
        pending = (rows, z, started)
        if len(loop.buffers) == 1:
            finish(*pending)
            pending = None
    if pending is not None:
        finish(*pending)
    if not gathered:
        return local.view(1, STATS, 0).expand(ranks, STATS, 0)
    return torch.cat(gathered, dim=2)  # once per call (16 bytes a token per rank)


def _recompute_loop(hc_all, wc, bc, terms: TokenTerms, shift: torch.Tensor, total: torch.Tensor, chunk: int,
                    grads) -> None:
    """The recompute strategy's backward: each chunk's logits again, then its gradient from the
    forward's softmax ``M`` and ``S`` (as statistics of one rank: max ``M``, sum ``S``)."""
    loop = KernelChunks(hc_all, wc, chunk, 1)
    stats = torch.zeros(1, STATS, shift.shape[0], dtype=torch.float32, device=shift.device)
    stats[0, 0], stats[0, 1] = shift, total  # only the max and the sum are read
    for index, rows in loop.ranges():
        z = loop.logits(hc_all[rows], wc, bc, index)
        chunk_grads(terms.grad_(loop.kernels, z, stats[:, :, rows], rows), hc_all[rows], wc, rows, grads)


def forward_chunks(hc_all, wc, bc, weight_dtype, tokens: TokenInputs, wanted, cfg) -> ChunkResults:
    """Every chunk of the forward on this loop: the call's `ChunkResults`, with ``(grad_h, grad_w,
    grad_b)`` where ``wanted`` (grad_h in the matmul dtype, grad_w in the weight's or fp32 with
    ``cfg.fp32_weight_grad``). ``cfg`` is the call's `fused_ce.CEConfig`."""
    grads = grad_buffers(hc_all, wc, wanted, hc_all.dtype, torch.float32 if cfg.fp32_weight_grad else weight_dtype)
    terms = token_terms(tokens, cfg)
    every = _forward_loop(hc_all, wc, bc, terms, cfg.label_smoothing > 0, cfg.group, cfg.chunk_size, grads)
    shift, total = combined_stats(every)
    z_target = every[:, TARGET].sum(dim=0)
    losses = token_losses(shift, total, z_target, every[:, SMOOTH].sum(dim=0), cfg.label_smoothing,
                          cfg.smoothing_classes)
    return ChunkResults(torch.where(tokens.valid, losses, 0.0), shift, total,
                        z_target if tokens.offset is not None else None, correct_tokens(every) & tokens.valid, grads)


def recompute_chunks(hc_all, wc, bc, weight_dtype, tokens: TokenInputs, shift, total, wanted, cfg):
    """The recompute strategy's backward on this loop: ``(grad_h, grad_w, grad_b)`` where ``wanted``."""
    grads = grad_buffers(hc_all, wc, wanted, hc_all.dtype, torch.float32 if cfg.fp32_weight_grad else weight_dtype)
    _recompute_loop(hc_all, wc, bc, token_terms(tokens, cfg), shift, total, cfg.chunk_size, grads)
    return grads
