"""Randomised truncated SVD of a matrix whose rows are sharded over a TP group.

``A`` is (M, N) with rank ``r`` holding rows ``A_r`` (M_r, N), any balanced or uneven split. The
method is Halko, Martinsson & Tropp (2011), Algorithm 4.4 (randomised range finder with power
iterations) followed by Algorithm 5.1 (direct SVD of ``Q^T A``):

1. ``Y = A Omega`` with a Gaussian ``Omega`` (N, k), the same on every rank: ``Y_r = A_r Omega``.
2. ``q`` power iterations, each re-orthonormalised: ``Q = qr(Y)``, ``Z = qr(A^T Q)``, ``Y = A Z``;
   ``A^T Q = sum_r A_r^T Q_r`` is one all-reduce of (N, k).
3. ``Q = qr(Y)``; ``B = Q^T A = sum_r Q_r^T A_r``, one all-reduce of (k, N); ``B = U_B S V^T`` on
   every rank (small, identical input, identical result); this rank's rows of ``U`` are ``Q_r U_B``.

Every QR of a row-sharded tall matrix is TSQR: each rank factors its block, ``Y_r = Q1_r R_r``; one
all-gather of the small ``R_r`` (k x k each), a QR of their stack, ``[R_1; ...] = Q2 R``; then
``Q_r = Q1_r Q2_r``. No rank ever holds ``A`` or ``Y`` whole. ``k = rank + oversample`` (capped at
min(M, N)); the expected error is within a factor ``(1 + 11 sqrt(k min(M, N)))^(1/(2q+1))`` of the
best rank-``rank`` approximation's (HMT Theorem 10.6 / eq. 1.11), and the method is exact when
``k = min(M, N)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..parallel import comm


@dataclass
class ShardedSVD:
    """``A ~= U diag(S) V^T``: ``U_local`` this rank's rows of U (M_r, k), ``S`` (k,) and ``V`` (N, k)
    on every rank, singular values in descending order; ``frob2``: ``||A||_F^2`` (all of A)."""

    U_local: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    frob2: float

    def rank_for_energy(self, energy: float) -> Optional[int]:
        """The smallest r with ``sum(S[:r]^2) >= energy * ||A||_F^2``; None if these S do not reach it."""
        kept = torch.cumsum(self.S.double() ** 2, 0)
        # A relative slack of 1e-6 so that energy=1 is reached despite rounding in the sums.
        hits = torch.nonzero(kept >= energy * self.frob2 * (1 - 1e-6))
        return int(hits[0]) + 1 if len(hits) else None


def tsqr(y_local: torch.Tensor, group) -> torch.Tensor:
    """Orthonormal ``Q`` with ``Q R = Y`` for ``Y`` sharded by rows; returns this rank's rows of Q."""
    q1, r1 = torch.linalg.qr(y_local)
    if comm.group_size(group) == 1:
        return q1
    sizes = comm.all_gather_sizes(r1.shape[0], group, r1.device)
    stacked = comm.all_gather_dim(r1.contiguous(), 0, group, sizes)
    q2, _ = torch.linalg.qr(stacked)
    start = sum(sizes[: comm.group_rank(group)])
    return q1 @ q2[start : start + r1.shape[0]]


def sharded_svd(
    a_local: torch.Tensor,
    rank: int,
    group=None,
    *,
    oversample: int = 10,
    power_iters: int = 2,
    seed: int = 0,
) -> ShardedSVD:
    """Top ``rank + oversample`` singular triplets of the row-sharded ``A`` (see the module docstring).

    Collective over ``group`` (every rank calls it with its rows; ``seed`` must agree).
    Computed in float32 at least (float64 inputs stay float64).
    """
    dtype = torch.promote_types(a_local.dtype, torch.float32)
    a = a_local.to(dtype)
    n = a.shape[1]
    m = sum(comm.all_gather_sizes(a.shape[0], group, a.device))
    k = min(rank + oversample, m, n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(n, k, generator=gen, dtype=dtype).to(a.device)
    frob2 = comm.all_reduce_(a.pow(2).sum().double().reshape(1), group).item()

    q = tsqr(a @ omega, group)
    for _ in range(power_iters):
        z = comm.all_reduce_(a.t() @ q, group)  # A^T Q, (N, k), on every rank
        z, _ = torch.linalg.qr(z)
        q = tsqr(a @ z, group)
    b = comm.all_reduce_(q.t() @ a, group)  # Q^T A, (k, N)
    u_b, s, vh = torch.linalg.svd(b, full_matrices=False)
    return ShardedSVD(U_local=q @ u_b, S=s, V=vh.t(), frob2=frob2)
