"""The Newton-Schulz orthogonalisation of one whole matrix, Muon's learning-rate rules and their cost.

`orthogonalize` is ``torch.optim.Muon``'s iteration (the quintic of Keller Jordan's Muon) in a dtype
the caller picks: torch runs it in bf16 always; bigdense runs it in bf16 on GPUs, as the field does,
and in fp32 on CPUs, where bf16 matmuls are slow and no test could compare them. Per iteration, for
an (m, n) matrix X with m <= n (a taller one is transposed first, and back at the end):

    A = X X^T                 (m, m):  2 m^2 n FLOPs
    B = b A + c A A           (m, m):  2 m^3
    X = a X + B X             (m, n):  2 m^2 n

so `ns_flops` = ``steps * (4 m^2 n + 2 m^3)`` (the normalisation and casts are O(mn)). Eager, a call
launches ``3 * steps`` GEMMs and 4 elementwise kernels (cast, norm, clamp, divide; the transposes are
views); compiled (`orthogonalizer`), the elementwise ones fuse into the norm's reduction and one
pointwise kernel, and the GEMMs stay cuBLAS's: worth it on a GPU, where a launch costs about as much
as a small matrix's normalisation, and not on a CPU (inductor needs a C++ compiler there and the
iteration is GEMM-bound), hence ``optim.ns_compile=auto``: on CUDA only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

ADJUST_LR = ("match_rms_adamw", "original", "none")  # optim.adjust_lr
NS_COMPILE = ("auto", "on", "off")  # optim.ns_compile: auto compiles on CUDA devices
DEFAULT_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (a, b, c)


def orthogonalize(update: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``steps`` Newton-Schulz iterations on ``update`` (2-D) in ``dtype``, as ``torch.optim.Muon``
    runs them: scaled to Frobenius norm <= 1, then X <- a X + (b A + c A^2) X with A = X X^T.
    Returns a new tensor in ``dtype``, shaped like ``update``."""
    a, b, c = (float(v) for v in coefficients)
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(shape, rule: str) -> float:
    """What the learning rate is multiplied by for a matrix of ``shape`` (rows, cols), as
    ``torch.optim.Muon``'s ``adjust_lr_fn``: ``match_rms_adamw`` (Moonlight's 0.2 sqrt(max(A, B)): the
    update's RMS matches AdamW's, so one LR and weight decay serve both), ``original`` (Keller
    Jordan's sqrt(max(1, A / B))), ``none`` (1)."""
    rows, cols = int(shape[0]), int(shape[1])
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def ns_flops(shape, steps: int) -> int:
    """Floating-point operations of `orthogonalize` on a matrix of ``shape`` (GEMMs only)."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * n + 2 * m ** 3)


def ns_dtype(name: str, device_type: str) -> torch.dtype:
    """``optim.ns_dtype``: ``auto`` is bf16 on CUDA devices, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def orthogonalizer(backend: Optional[str]):
    """`orthogonalize`, compiled with ``backend`` (one graph per matrix shape, static shapes, no
    break), or itself when ``backend`` is None."""
    if backend is None:
        return orthogonalize
    return torch.compile(orthogonalize, backend=backend, dynamic=False, fullgraph=True)


def ns_backend(setting: str, device_type: str) -> Optional[str]:
    """``optim.ns_compile``'s compiler backend: inductor on CUDA for ``auto``, always for ``on``."""
    if setting == "on" or (setting == "auto" and device_type == "cuda"):
        return "inductor"
    return None
