"""The fused cross-entropy's two passes over a chunk of logits, and which implementation runs them.

A chunk's logits ``z`` are (n, C) tokens-major, in the matmul dtype, one row per token and one
column per class of this rank. The loss sees ``x = cap(z)``, with ``cap(z) = c * tanh(z / c)`` for a
softcap ``c`` (`softcap`; the identity for ``c = 0``), plus ``offset`` at the target (a margin). Two
passes read them:

* `row_stats`: each token's softmax statistics over this rank's classes, in fp32 (`STATS` rows) --
  the max ``m``, ``s = sum exp(x - m)``, the target's logit (0 where the target is another rank's
  class or the token is ignored) and, for label smoothing, the sum of the logits of the real classes;
* `softmax_grad_`: once every rank's statistics are at hand, in place of the logits the loss
  gradient ``w * ((1 + 2 zl lse) softmax - (1 - eps) onehot(target) - eps / C) * cap'(z)`` for the
  token's weight ``w`` (d loss / d loss_i; 0 for an ignored token, NaN for a bad label) and a z-loss
  coefficient ``zl`` (the loss ``zl * lse**2``).

Precision: the softmax is formed as ``exp((x - M) - log S)`` from every rank's largest logit ``M``
and the rescaled sum ``S`` (`combined_stats`), never as ``exp(x - lse)``: at logits near 1e4 an fp32
``lse`` is itself rounded by ~1e-3, which ``exp`` would turn into a relative error of the softmax;
``x - M`` is exact there.

The functions here are the torch reference: the oracle of the Triton kernels (`triton_ce`, the same
contract element for element) and what runs where Triton does not. `ce_kernels(device)` picks one.
A ``target`` is the token's local class index, -1 where this rank does not hold it (or the token is
ignored); ``offset`` (n,) fp32, or None, is added to the target's logit (a margin); ``real`` (C,)
bool, or None, marks the columns that are classes -- the others are a sample's padding, whose logit
is -inf and which label smoothing does not spread over.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# `BIGDENSE_CE_KERNELS`: which implementation the head's GPU loop uses, for tests and comparisons.
# "triton" (also on CPU tensors, where TRITON_INTERPRET=1 makes Triton interpret the kernels) or
# "torch" (the references), both forcing that loop on any device; "off" keeps every device on the
# CPU-shaped loop (`layers/head/ce_chunks.py`). Unset: the GPU loop with Triton on CUDA, the
# CPU-shaped loop on CPU.
KERNELS_ENV = "BIGDENSE_CE_KERNELS"
IMPLEMENTATIONS = ("triton", "torch")
CHOICES = (*IMPLEMENTATIONS, "off")

# The rows of a token's statistics, as `row_stats` writes them and the all-gather sends them.
MAX, SUM, TARGET, SMOOTH = range(4)
STATS = 4


def kernels_choice() -> Optional[str]:
    """`KERNELS_ENV`'s value (None when unset), checked."""
    chosen = os.environ.get(KERNELS_ENV) or None
    if chosen is not None and chosen not in CHOICES:
        raise ValueError(f"{KERNELS_ENV}={chosen!r}: expected one of {CHOICES}")
    return chosen


def softcapped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(z / softcap)`` (fp32 ``z``; ``z`` itself for a softcap of 0)."""
    return z if not softcap else torch.tanh(z / softcap) * softcap


def _with_offset(x: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor]) -> torch.Tensor:
    if offset is None or x.shape[1] == 0:
        return x
    at_target = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == target.unsqueeze(1)
    return torch.where(at_target, x + offset.unsqueeze(1), x)


def row_stats(z: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor], real: Optional[torch.Tensor],
              smoothing: bool, out: torch.Tensor, softcap: float = 0.0) -> torch.Tensor:
    """Write ``out`` (`STATS`, n) fp32: max, sum of exp(x - max), target logit, sum of real logits
    (0 unless ``smoothing``). A token whose columns here are all -inf (or a rank with no class) has
    a max of -inf and a sum of 0. Reads ``z`` once; writes 16 bytes per token."""
    if z.shape[1] == 0:
        out[MAX].fill_(float("-inf"))
        out[SUM:].zero_()
        return out
    x = _with_offset(softcapped(z.float(), softcap), target, offset)
    big = x.amax(dim=1)
    shift = torch.where(big == float("-inf"), 0.0, big)
    out[MAX] = big
    out[SUM] = torch.exp(x - shift.unsqueeze(1)).sum(dim=1)
    picked = x.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    out[TARGET] = torch.where(target >= 0, picked, 0.0)
    if smoothing:
        out[SMOOTH] = (x if real is None else torch.where(real.unsqueeze(0), x, 0.0)).sum(dim=1)
    else:
        out[SMOOTH] = 0.0
    return out


def combined_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, S)`` per token from every rank's (R, `STATS`, n) statistics, in rank order: the largest
    max ``M`` (0 where no rank scores a class) and ``S = sum_r s_r exp(m_r - M)`` (0 there), so that
    ``lse = M + log S`` and the softmax is ``exp((x - M) - log S)`` (what the kernel computes)."""
    big = stats[:, MAX].amax(dim=0)
    shift = torch.where(big == float("-inf"), 0.0, big)
    return shift, (stats[:, SUM] * torch.exp(stats[:, MAX] - shift)).sum(dim=0)


def combined_lse(stats: torch.Tensor) -> torch.Tensor:
    """``logsumexp_r(m_r + log s_r)`` per token (-inf where no rank scores a class)."""
    shift, total = combined_stats(stats)
    return shift + total.log()


def correct_tokens(stats: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the target's logit is the largest of every rank's classes (both come from the
    same values, so equality is exact). A tie for the largest counts as right, where ``argmax`` of
    the whole row would pick the lowest class id: telling the two apart takes each rank's first
    largest index, a pass a CPU makes 8x slower than the max itself, for ties that fp32 logits all
    but never have."""
    return stats[:, TARGET].sum(dim=0) == stats[:, MAX].amax(dim=0)


def softmax_grad_(z: torch.Tensor, stats: torch.Tensor, target: torch.Tensor, offset: Optional[torch.Tensor],
                  real: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                  smooth: Optional[torch.Tensor], softcap: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    """Overwrite ``z`` (n, C) with ``weight * ((1 + 2 z_loss lse) softmax - (1 - eps)
    onehot(target) - smooth) * cap'(z)``, the softmax from ``stats`` (R, `STATS`, n), every rank's
    `row_stats` of these tokens; ``smooth`` a device scalar (eps / classes), subtracted on real
    columns, None without smoothing; ``cap'(z) = 1 - tanh(z / c)**2`` with a softcap. Reads and
    writes ``z`` once."""
    if z.shape[1] == 0:
        return z
    shift, total = combined_stats(stats)
    live = total != 0  # NaN statistics stay NaN (a bad step must show in its gradient norm)
    log_total = torch.where(live, total, 1.0).log()
    capped = softcapped(z.float(), softcap)
    x = _with_offset(capped, target, offset)
    p = torch.where(live.unsqueeze(1), torch.exp((x - shift.unsqueeze(1)) - log_total.unsqueeze(1)), 0.0)
    scale = weight if not z_loss else weight * (1.0 + 2.0 * z_loss * (shift + log_total))
    grad = p * scale.unsqueeze(1)
    at_target = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == target.unsqueeze(1)
    grad = grad - torch.where(at_target, ((1.0 - eps) * weight).unsqueeze(1), 0.0)
    if smooth is not None:
        spread = (smooth * weight).unsqueeze(1)
        grad = grad - (spread if real is None else torch.where(real.unsqueeze(0), spread, 0.0))
    if softcap:
        grad = grad * (1.0 - (capped / softcap) ** 2)
    return z.copy_(grad)


@dataclass(frozen=True)
class CEKernels:
    """One implementation of the two passes: ``name`` and the functions of this module's signatures."""

    name: str
    row_stats: Callable
    softmax_grad_: Callable


TORCH = CEKernels("torch", row_stats, softmax_grad_)


@functools.lru_cache(maxsize=None)
def _triton_kernels(interpret: bool) -> CEKernels:
    # Imported here only: Triton is needed where a CUDA device (or the interpreter) runs the kernels.
    # Cached per interpreter switch, which Triton reads when the kernels are defined.
    try:
        from . import triton_ce
    except ImportError as err:
        raise ImportError(f"the classifier head's GPU kernels need Triton ({err}); install it (torch's CUDA builds "
                          f"bring it), or set {KERNELS_ENV}=torch (the torch references, slower) or "
                          f"{KERNELS_ENV}=off (the CPU-shaped loop)") from err
    return CEKernels("triton", triton_ce.row_stats, triton_ce.softmax_grad_)


def ce_kernels(device: torch.device) -> CEKernels:
    """The implementation for tensors on ``device``: `KERNELS_ENV` if set, else Triton on CUDA."""
    chosen = kernels_choice() or ("triton" if device.type == "cuda" else "torch")
    if chosen == "torch":
        return TORCH
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        raise ValueError(f"{KERNELS_ENV}=triton on {device.type} tensors needs TRITON_INTERPRET=1 "
                         "(Triton runs on CPU tensors only through its interpreter)")
    return _triton_kernels(interpret)
