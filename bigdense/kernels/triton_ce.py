"""Triton kernels of the fused cross-entropy's two passes (contract and torch oracle: `softmax_ce`).

One program per token row, walking its classes in blocks of ``BLOCK`` columns with fp32 registers:

* `_row_stats_kernel` reads each logit once (2 bytes in bf16) and writes 4 fp32 numbers per token
  (`softmax_ce.STATS`): an online max and rescaled sum of exponentials, the target's logit, the
  smoothing sum.
* `_softmax_grad_kernel` reads every rank's statistics of its token (R x 2 floats), forms the
  largest max ``M`` and the rescaled sum ``S``, then reads each logit and writes its gradient in
  place (2 + 2 bytes per logit in bf16), the softmax as ``exp((x - M) - log S)``.

With a softcap ``c`` (``SOFTCAP``) each logit is ``c * tanh(z / c)`` in registers (`_tanh`: no
libdevice call, which Triton's interpreter cannot run), and its gradient is multiplied by
``1 - tanh(z / c)**2``; a z-loss coefficient (``Z_LOSS``) scales the softmax term by
``1 + 2 zl lse``. Neither reads or writes a byte more.

The two entry points, `row_stats` and `softmax_grad_`, launch through torch custom ops
(``bigdense::ce_row_stats``, ``bigdense::ce_softmax_grad_``, which declare what they mutate), so
``torch.compile`` of a whole model (``trainer.compile=model``) keeps each launch as one opaque op of
its graph, with no graph break, on a GPU and through the interpreter alike.

Imported only where the kernels run: a CUDA device, or the interpreter (``TRITON_INTERPRET=1``) on
CPU tensors, which is how the suite tests them. Values are loaded and computed in fp32 (the
interpreter does no bf16 arithmetic) and stored in the logits' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Columns a program holds at once: a power of two, large enough to keep a GPU's loads wide, small
# enough to stay in registers (16 warps x 32 lanes x 16 fp32 values).
MAX_BLOCK = 8192
NUM_WARPS = 16


@triton.jit
def _tanh(u):
    """tanh in fp32 from ``exp``: a short series below 1/4 (where ``1 - exp(-2|u|)`` would cancel),
    the exponential form above; within a few ulps of ``torch.tanh``."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(u < 0, -t, t)


@triton.jit
def _row_stats_kernel(z_ptr, z_stride, n_cols, target_ptr, offset_ptr, real_ptr, out_ptr, out_stride, softcap,
                      HAS_OFFSET: tl.constexpr, HAS_REAL: tl.constexpr, SMOOTHING: tl.constexpr,
                      SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    target = tl.load(target_ptr + row)
    shift_at_target = 0.0
    if HAS_OFFSET:
        shift_at_target = tl.load(offset_ptr + row)
    big = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    z_target = tl.full([], 0.0, tl.float32)
    z_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            x = tl.where(inside, softcap * _tanh(x / softcap), float("-inf"))
        at_target = cols == target
        x = tl.where(at_target, x + shift_at_target, x)
        new_big = tl.maximum(big, tl.max(x, axis=0))
        shift = tl.where(new_big == float("-inf"), 0.0, new_big)
        total = total * tl.exp(big - shift) + tl.sum(tl.exp(x - shift), axis=0)
        big = new_big
        z_target += tl.sum(tl.where(at_target, x, 0.0), axis=0)
        if SMOOTHING:
            keep = inside
            if HAS_REAL:
                keep = keep & (tl.load(real_ptr + cols, mask=inside, other=0) != 0)
            z_sum += tl.sum(tl.where(keep, x, 0.0), axis=0)
    tl.store(out_ptr + row, big)
    tl.store(out_ptr + out_stride + row, total)
    tl.store(out_ptr + 2 * out_stride + row, z_target)
    tl.store(out_ptr + 3 * out_stride + row, z_sum)


@triton.jit
def _softmax_grad_kernel(z_ptr, z_stride, n_cols, stats_ptr, stats_rank_stride, stats_stride, n_ranks,
                         target_ptr, offset_ptr, real_ptr, weight_ptr, smooth_ptr, on_target, softcap, z_loss,
                         HAS_OFFSET: tl.constexpr, HAS_REAL: tl.constexpr, SMOOTHING: tl.constexpr,
                         SOFTCAP: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # M and S over every rank's statistics, in rank order (the torch reference's `combined_stats`).
    big = tl.full([], float("-inf"), tl.float32)
    for r in range(n_ranks):
        big = tl.maximum(big, tl.load(stats_ptr + r * stats_rank_stride + row))
    shift = tl.where(big == float("-inf"), 0.0, big)
    total = tl.full([], 0.0, tl.float32)
    for r in range(n_ranks):
        m_r = tl.load(stats_ptr + r * stats_rank_stride + row)
        s_r = tl.load(stats_ptr + r * stats_rank_stride + stats_stride + row)
        total += s_r * tl.exp(m_r - shift)
    live = total != 0.0  # (NaN statistics stay NaN)
    log_total = tl.log(tl.where(live, total, 1.0))
    weight = tl.load(weight_ptr + row)
    scale = weight
    if Z_LOSS:
        scale = weight * (1.0 + 2.0 * z_loss * (shift + log_total))
    target = tl.load(target_ptr + row)
    shift_at_target = 0.0
    if HAS_OFFSET:
        shift_at_target = tl.load(offset_ptr + row)
    spread = 0.0
    if SMOOTHING:
        spread = tl.load(smooth_ptr) * weight
    z_row = z_ptr + row * z_stride
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        slope = 1.0
        if SOFTCAP:
            t = _tanh(x / softcap)
            x = tl.where(inside, softcap * t, float("-inf"))
            slope = 1.0 - t * t
        at_target = cols == target
        x = tl.where(at_target, x + shift_at_target, x)
        p = tl.where(live, tl.exp((x - shift) - log_total), 0.0)
        grad = p * scale - tl.where(at_target, on_target * weight, 0.0)
        if SMOOTHING:
            keep = inside
            if HAS_REAL:
                keep = keep & (tl.load(real_ptr + cols, mask=inside, other=0) != 0)
            grad -= tl.where(keep, spread, 0.0)
        tl.store(z_row + cols, (grad * slope).to(z_ptr.dtype.element_ty), mask=inside)


def _block(n_cols: int, block: Optional[int]) -> int:
    return block or min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))


def _placeholder(pointer: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A tensor to pass where an optional input is absent (its HAS_ switch keeps it unread)."""
    return like if pointer is None else pointer


def _launch_row_stats(z: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor],
                      real: Optional[torch.Tensor], smoothing: bool, out: torch.Tensor, softcap: float = 0.0,
                      block: Optional[int] = None) -> None:
    """`softmax_ce.row_stats` in one launch of ``n`` programs; writes ``out``."""
    n, n_cols = z.shape
    if n == 0:
        return
    assert z.stride(1) == 1 and out.stride(1) == 1, "row_stats: rows of z and out must be contiguous"
    _row_stats_kernel[(n,)](
        z, z.stride(0), n_cols, target, _placeholder(offset, out), _placeholder(real, target), out, out.stride(0),
        float(softcap or 1.0),
        HAS_OFFSET=offset is not None, HAS_REAL=real is not None, SMOOTHING=smoothing, SOFTCAP=bool(softcap),
        BLOCK=_block(n_cols, block), num_warps=NUM_WARPS,
    )


def _launch_softmax_grad(z: torch.Tensor, stats: torch.Tensor, target: torch.Tensor,
                         offset: Optional[torch.Tensor], real: Optional[torch.Tensor], weight: torch.Tensor,
                         eps: float, smooth: Optional[torch.Tensor], softcap: float = 0.0, z_loss: float = 0.0,
                         block: Optional[int] = None) -> None:
    """`softmax_ce.softmax_grad_` in one launch of ``n`` programs; writes ``z``."""
    n, n_cols = z.shape
    if n == 0 or n_cols == 0:
        return
    assert z.stride(1) == 1 and stats.stride(2) == 1, "softmax_grad_: rows of z and stats must be contiguous"
    _softmax_grad_kernel[(n,)](
        z, z.stride(0), n_cols, stats, stats.stride(0), stats.stride(1), stats.shape[0],
        target, _placeholder(offset, weight), _placeholder(real, target), weight, _placeholder(smooth, weight),
        1.0 - eps, float(softcap or 1.0), float(z_loss),
        HAS_OFFSET=offset is not None, HAS_REAL=real is not None, SMOOTHING=smooth is not None,
        SOFTCAP=bool(softcap), Z_LOSS=bool(z_loss), BLOCK=_block(n_cols, block), num_warps=NUM_WARPS,
    )


_row_stats_op = torch.library.custom_op("bigdense::ce_row_stats", _launch_row_stats, mutates_args=("out",))
_softmax_grad_op = torch.library.custom_op("bigdense::ce_softmax_grad_", _launch_softmax_grad, mutates_args=("z",))
_row_stats_op.register_fake(lambda *args, **kwargs: None)  # writes its argument, returns nothing
_softmax_grad_op.register_fake(lambda *args, **kwargs: None)


def row_stats(z: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor], real: Optional[torch.Tensor],
              smoothing: bool, out: torch.Tensor, softcap: float = 0.0, block: Optional[int] = None) -> torch.Tensor:
    """`softmax_ce.row_stats` in one launch of ``n`` programs (``bigdense::ce_row_stats``)."""
    _row_stats_op(z, target, offset, real, smoothing, out, softcap, block)
    return out


def softmax_grad_(z: torch.Tensor, stats: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor],
                  real: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                  smooth: Optional[torch.Tensor], softcap: float = 0.0, z_loss: float = 0.0,
                  block: Optional[int] = None) -> torch.Tensor:
    """`softmax_ce.softmax_grad_` in one launch of ``n`` programs (``bigdense::ce_softmax_grad_``)."""
    _softmax_grad_op(z, stats, target, offset, real, weight, eps, smooth, softcap, z_loss, block)
    return z


_SIGNATURES = {
    "_row_stats_kernel": {"z_ptr": "*bf16", "z_stride": "i64", "n_cols": "i32", "target_ptr": "*i64",
                          "offset_ptr": "*fp32", "real_ptr": "*i1", "out_ptr": "*fp32", "out_stride": "i64",
                          "softcap": "fp32"},
    "_softmax_grad_kernel": {"z_ptr": "*bf16", "z_stride": "i64", "n_cols": "i32", "stats_ptr": "*fp32",
                             "stats_rank_stride": "i64", "stats_stride": "i64", "n_ranks": "i32",
                             "target_ptr": "*i64", "offset_ptr": "*fp32", "real_ptr": "*i1", "weight_ptr": "*fp32",
                             "smooth_ptr": "*fp32", "on_target": "fp32", "softcap": "fp32", "z_loss": "fp32"},
}


def compile_for_cuda(capability: int = 90) -> dict:
    """Compile every kernel, for bf16 logits and its switches, for an NVIDIA GPU of compute
    ``capability`` down to its cubin, with no device: ``{(kernel, switches): bytes of cubin}``. The
    interpreter accepts code the compiler refuses; this is the check that needs no GPU. (Not under
    ``TRITON_INTERPRET=1``, where the kernels are the interpreter's.)"""
    import itertools

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    out = {}
    for kernel, extra in ((_row_stats_kernel, ("SOFTCAP",)), (_softmax_grad_kernel, ("SOFTCAP", "Z_LOSS"))):
        name = kernel.fn.__name__
        # Every combination of the three input switches with the logit options off, and all on once:
        # each instruction of both kernels is compiled at least once.
        combos = [(*switches, *(False,) * len(extra)) for switches in itertools.product((False, True), repeat=3)]
        for switches in combos + [(True,) * (3 + len(extra))]:
            constexprs = dict(zip(("HAS_OFFSET", "HAS_REAL", "SMOOTHING", *extra), switches), BLOCK=MAX_BLOCK)
            signature = {**_SIGNATURES[name], **{key: "constexpr" for key in constexprs}}
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=target,
                                      options={"num_warps": NUM_WARPS})
            out[(name, switches)] = len(compiled.asm["cubin"])
    return out
