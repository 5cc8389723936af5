"""The counter hash of bigdense's layout-free random numbers, and the dropout that applies it.

`fmix32` is MurmurHash3's 32-bit finaliser in int32 arithmetic, whose multiplications wrap modulo
2^32 on every backend; ">>" is arithmetic on signed integers, so each shift is masked to make it
logical. `bigdense.parallel.random` spreads indices into words with it; `bigdense.parallel.dropout`
keys a mask with it.

`keep_scale` is the full-size part of a dropout site, the torch reference of the Triton kernel
`triton_dropout.keep_scale` (the same contract element for element): element ``(i, j)`` of a
(n, m) tensor is kept, and scaled, when ``fmix32(row_word[i] ^ col_word[j])`` is below a threshold.
`dropout_kernels(device)` picks the implementation.
"""
from __future__ import annotations

import os

import torch

# MurmurHash3's fmix32 constants, written as signed int32.
M1, M2 = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32)

# `BIGDENSE_DROPOUT_KERNELS`: "triton" (on any device; CPU tensors through TRITON_INTERPRET=1) or
# "torch" forces that implementation of `keep_scale`; unset: Triton on CUDA, torch elsewhere.
KERNELS_ENV = "BIGDENSE_DROPOUT_KERNELS"


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int32 tensors: a bijection of 32-bit words with full avalanche."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * M2
    return h ^ ((h >> 16) & 0xFFFF)


def keep_scale(x: torch.Tensor, row_word: torch.Tensor, col_word: torch.Tensor, threshold: int,
               scale: float) -> torch.Tensor:
    """``x`` (n, m) times its keep-mask times ``scale``: element ``(i, j)`` is kept when
    ``fmix32(row_word[i] ^ col_word[j])`` (int32) is below ``threshold`` (a signed int32; above
    2^31 - 1 every element is kept). About 14 full-size ops; the mask is what autograd saves."""
    if threshold > 2**31 - 1:
        return x * scale
    return x * kept(row_word, col_word, threshold) * scale


def kept(row_word: torch.Tensor, col_word: torch.Tensor, threshold: int) -> torch.Tensor:
    """The keep-mask (bool, (n, m)) of `keep_scale`: ``fmix32(row_word[i] ^ col_word[j]) < threshold``
    (every element kept above 2^31 - 1)."""
    word = fmix32(row_word.unsqueeze(1) ^ col_word.unsqueeze(0))  # uniform over the 2^32 words
    return word < threshold if threshold <= 2**31 - 1 else torch.ones_like(word, dtype=torch.bool)


def dropout_kernels(device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: `KERNELS_ENV` if set, else Triton on CUDA."""
    chosen = os.environ.get(KERNELS_ENV, "").strip().lower()
    if chosen not in ("", "triton", "torch"):
        raise ValueError(f"{KERNELS_ENV} must be triton or torch, got {chosen!r}")
    return chosen or ("triton" if device.type == "cuda" else "torch")
