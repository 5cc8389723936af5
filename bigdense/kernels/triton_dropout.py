"""The dropout site as one Triton pass each way (contract and torch oracle: `counter_hash.keep_scale`).

`keep_scale` reads each element of ``x`` once (its dtype's bytes) and the words of its row and
column (int32, a row's shared by its programs), hashes them (`_fmix32`, int32 arithmetic that wraps
as torch's does), and writes ``x * scale`` where kept, ``x * 0`` elsewhere, once: 2 x the element
size per element, no mask in memory. The backward of a dropout site is the same pass over the
incoming gradient (`KeepScale`), which saves only the two word vectors (n + m int32): the mask is
regenerated, never stored.

Imported only where the kernel runs: a CUDA device, or the interpreter (``TRITON_INTERPRET=1``) on
CPU tensors, which is how the suite tests it. Products are formed in fp32 and stored in ``x``'s
dtype, as torch's ``x * scale`` rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counter_hash import M1, M2

BLOCK = 1024


@triton.jit
def _fmix32(h, m1: tl.constexpr, m2: tl.constexpr):
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * m1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * m2
    return h ^ ((h >> 16) & 0xFFFF)


@triton.jit
def _keep_scale_kernel(x_ptr, out_ptr, row_ptr, col_ptr, n_cols, threshold, scale,
                       m1: tl.constexpr, m2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    row_word = tl.load(row_ptr + row)
    col_word = tl.load(col_ptr + cols, mask=inside, other=0)
    word = _fmix32(row_word ^ col_word, m1, m2)
    keep = tl.where(word < threshold, 1.0, 0.0)
    offsets = row.to(tl.int64) * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (x * keep * scale).to(out_ptr.dtype.element_ty), mask=inside)


def _launch(x: torch.Tensor, row_word: torch.Tensor, col_word: torch.Tensor, threshold: int,
            scale: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n, m = x.shape
    if n and m:
        _keep_scale_kernel[(n, triton.cdiv(m, BLOCK))](x, out, row_word, col_word, m, threshold, scale,
                                                       m1=M1, m2=M2, BLOCK=BLOCK)
    return out


class KeepScale(torch.autograd.Function):
    """`keep_scale` forward and backward, each one launch; saves the word vectors only."""

    @staticmethod
    def forward(ctx, x, row_word, col_word, threshold: int, scale: float):
        ctx.save_for_backward(row_word, col_word)
        ctx.threshold, ctx.scale = threshold, scale
        return _launch(x, row_word, col_word, threshold, scale)

    @staticmethod
    def backward(ctx, grad):
        row_word, col_word = ctx.saved_tensors
        return _launch(grad, row_word, col_word, ctx.threshold, ctx.scale), None, None, None, None


def keep_scale(x: torch.Tensor, row_word: torch.Tensor, col_word: torch.Tensor, threshold: int,
               scale: float) -> torch.Tensor:
    """`counter_hash.keep_scale` in one launch each way (threshold above 2^31 - 1: all kept)."""
    if threshold > 2**31 - 1:
        return x * scale
    return KeepScale.apply(x, row_word, col_word, threshold, scale)


def compile_for_cuda(capability: int = 90) -> dict:
    """Compile the kernel for fp32 and bf16 activations for an NVIDIA GPU of compute ``capability``
    down to its cubin, with no device: ``{dtype: bytes of cubin}`` (the check that needs no GPU;
    not under ``TRITON_INTERPRET=1``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for dtype in ("fp32", "bf16"):
        constexprs = dict(m1=M1, m2=M2, BLOCK=BLOCK)
        signature = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "row_ptr": "*i32", "col_ptr": "*i32",
                     "n_cols": "i32", "threshold": "i32", "scale": "fp32", **{k: "constexpr" for k in constexprs}}
        compiled = triton.compile(ASTSource(_keep_scale_kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", capability, 32))
        out[dtype] = len(compiled.asm["cubin"])
    return out
