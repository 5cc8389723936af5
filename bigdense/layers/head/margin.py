"""Additive-angular and additive-cosine margins (ArcFace, CosFace), in InsightFace's combined form.

With L2-normalised features and class weights every logit is ``s * cos(theta_j)``; the target's
becomes ``s * (cos(m1 * theta + m2) - m3)``. ``"arcface"`` is ``(1, 0.5, 0)``, ``"cosface"``
``(1, 0, 0.35)``. Where ``m1 * theta + m2`` would pass ``pi`` (the margin would stop being a
penalty: cos turns back up) the target logit is InsightFace's linear continuation
``cos(theta) - m3 - m2 * sin(pi - m2)`` instead (ArcFace's ``theta > pi - m`` rule, applied at
``theta > (pi - m2) / m1``). `target_logit` works on a handful of target logits per chunk: the margin
never touches the other classes' logits, so nothing of size tokens x classes is made for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.35)}

MarginSpec = Union[None, str, tuple]


@dataclass(frozen=True)
class Margin:
    """``cos(m1 * theta + m2) - m3`` on the target, everything scaled by ``scale``."""

    m1: float
    m2: float
    m3: float
    scale: float

    @property
    def _cos_threshold(self) -> float:
        """Targets with cos(theta) above this are in the region where the margin formula applies."""
        limit = (math.pi - self.m2) / self.m1
        return -math.inf if limit >= math.pi else math.cos(limit)

    def target_logit(self, z: torch.Tensor) -> torch.Tensor:
        """``s * phi(z / s)`` for fp32 target logits ``z = s * cos(theta)``; differentiable (the
        slope of ``theta`` at cos = +-1, infinite, is kept finite)."""
        c = (z / self.scale).clamp(-1.0, 1.0)
        sin = torch.sqrt((1.0 - c * c).clamp_min(1e-12))
        if self.m1 == 1.0:  # InsightFace's ArcFace form: cos(theta + m) = c cos m - sin(theta) sin m
            inside = c * math.cos(self.m2) - sin * math.sin(self.m2)
        else:
            inside = torch.cos(self.m1 * torch.atan2(sin, c) + self.m2)
        keep = c > self._cos_threshold
        phi = torch.where(keep, inside, c - self.m2 * math.sin(math.pi - self.m2)) - self.m3
        return self.scale * phi


def resolve_margin(margin: MarginSpec, scale: float, where: str) -> Optional[Margin]:
    """``None``, a name from `MARGINS` or a tuple ``(m1, m2, m3)`` -> a `Margin` (or None).

    ``where`` names the layer in errors."""
    if margin is None:
        return None
    if isinstance(margin, str):
        if margin not in MARGINS:
            raise ValueError(f"{where}: margin must be None, one of {sorted(MARGINS)} or a tuple (m1, m2, m3), "
                             f"got {margin!r}")
        m = MARGINS[margin]
    else:
        try:
            m = tuple(float(v) for v in margin)
        except (TypeError, ValueError):
            m = ()
        if len(m) != 3:
            raise ValueError(f"{where}: margin must be None, one of {sorted(MARGINS)} or a tuple (m1, m2, m3), "
                             f"got {margin!r}")
    m1, m2, m3 = m
    if not (m1 > 0 and 0 <= m2 < math.pi and m3 >= 0 and all(math.isfinite(v) for v in m)):
        raise ValueError(f"{where}: margin (m1, m2, m3) needs m1 > 0, 0 <= m2 < pi and m3 >= 0, got {m}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a positive number, got {scale!r}")
    return Margin(m1, m2, m3, float(scale))


class UnitRows(torch.autograd.Function):
    """``F.normalize(x, dim=-1, eps=eps)`` with a shorter backward. forward: each row over its L2 norm
    (at least ``eps``); backward: the gradient less its component along the row's unit vector, over
    the norm (only over ``eps`` where the norm is below it, as F.normalize's clamp gives). No
    collective. Autograd's backward of the division takes six passes over x's size; this takes four,
    and the weight rows of a sampled margin head are the largest tensor the head normalises."""

    @staticmethod
    def forward(ctx, x, eps: float):
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        inv = norm.clamp_min(eps).reciprocal_()
        unit = x * inv
        ctx.save_for_backward(unit, inv, norm >= eps)
        return unit

    @staticmethod
    def backward(ctx, grad):
        unit, inv, unclamped = ctx.saved_tensors
        along = (grad * unit).sum(-1, keepdim=True).mul_(unclamped)
        return torch.addcmul(grad, unit, along, value=-1).mul_(inv), None


def unit_rows(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each row of ``x`` scaled to unit length, as ``F.normalize(x, dim=-1)``: see `UnitRows`."""
    return UnitRows.apply(x, eps)


class _ScaleGrad(torch.autograd.Function):
    """forward: identity; backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def target_offset(
    margin: Margin,
    h_unit: torch.Tensor,
    w_unit: torch.Tensor,
    target: torch.Tensor,
    class_start: int,
    ignore_index: int,
    class_group,
    tp_group,
    weight_grad_factor: float = 1.0,
) -> torch.Tensor:
    """What the margin adds to each token's target logit, ``s * phi(cos) - s * cos`` (N,), the same
    on every rank of ``class_group``, differentiable in ``h_unit`` (N, D) and ``w_unit`` (this
    rank's unit class vectors, C_local x D).

    Each rank scores the tokens whose target it holds (one dot product each, never a logits row)
    and one all-reduce over ``class_group`` gives every rank every token's target cosine; the
    gradient flows back to the holding rank's class row and, summed over ``tp_group``, to ``h``.
    ``weight_grad_factor`` scales the class rows' gradient (the DP average of a world-sharded head).
    """
    from ...parallel.regions import copy_to_tp, reduce_from_tp

    c_local = w_unit.shape[0]
    t_local = target - class_start
    here = (target != ignore_index) & (t_local >= 0) & (t_local < c_local)
    # Every rank routes h through the TP copy, also one that holds no class (num_classes < tp, or
    # an empty sample): its backward is an all-reduce over TP, which all of them must join.
    h_tp = copy_to_tp(h_unit, tp_group)
    if c_local:
        if weight_grad_factor != 1.0:
            w_unit = _ScaleGrad.apply(w_unit, weight_grad_factor)
        rows = w_unit.index_select(0, t_local.clamp(0, c_local - 1))
    else:  # no class here: a zero contribution to every token's cosine (and to h's gradient)
        rows = h_tp.new_zeros(h_tp.shape)
    cos = (h_tp * rows).sum(1).float() * here
    z = margin.scale * reduce_from_tp(cos, class_group)
    return margin.target_logit(z) - z
