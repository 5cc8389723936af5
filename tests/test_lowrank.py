"""bd.low_rank and the sharded randomised SVD against torch.linalg.svd of the whole matrix.

The reference is written here: float64 ``torch.linalg.svd`` of the unsharded weight, truncated to
rank r (Eckart-Young's best approximation; unique when sigma_r > sigma_{r+1}, which the test
spectra guarantee). Tolerances: when the sketch covers the whole spectrum (k = min(M, N)) the
randomised method is exact and only fp32 rounding of a few QRs and matmuls over values of order 1
remains: 2e-5 absolute/relative (~100 ulps). When it does not, HMT's bound applies; with a spectrum
decaying by 0.7 per index and 2 power iterations the expected excess error is far below 1%, which
is what is asserted.
"""
import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.compression.svd import sharded_svd
from bigdense.parallel import comm
from bigdense.parallel.sharding import ShardSpec
from bigdense.testing import run_ranks

EXACT = dict(atol=2e-5, rtol=2e-5)


def spectrum_matrix(out_f, in_f, decay=0.7, seed=0):
    """A weight with singular values decay**i (distinct, with gaps), random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(out_f, in_f)
    u, _ = torch.linalg.qr(torch.randn(out_f, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(in_f, k, generator=g, dtype=torch.float64))
    s = decay ** torch.arange(k, dtype=torch.float64)
    return (u * s) @ v.t(), s


def truncated(w, r):
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]


def _dense(out_f, in_f, seed=0):
    w, _ = spectrum_matrix(out_f, in_f, seed=seed)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(w.float())
        lin.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(seed + 1))
    return lin


def test_linear_pair_is_the_truncated_svd():
    lin = _dense(13, 10)
    pair = bd.low_rank(lin, rank=4)
    assert isinstance(pair, nn.Sequential) and pair.rank == 4
    first, second = pair
    assert first.weight.shape == (4, 10) and second.weight.shape == (13, 4) and first.bias is None
    torch.testing.assert_close((second.weight @ first.weight).double(), truncated(lin.weight, 4), **EXACT)
    x = torch.randn(5, 10)
    expect = x.double() @ truncated(lin.weight, 4).t() + lin.bias.double()
    torch.testing.assert_close(pair(x).double(), expect, **EXACT)


def _parallel_pair(kind, out_f, in_f, r, tp):
    bd.init_parallel(tp=tp)
    lin = _dense(out_f, in_f)
    cls = bd.ColumnParallelLinear if kind == "column" else bd.RowParallelLinear
    layer = cls.from_dense(lin)
    pair = bd.low_rank(layer, rank=r)
    first, second = pair
    if kind == "column":
        assert isinstance(first, nn.Linear) and isinstance(second, bd.ColumnParallelLinear)
        w_first, w_second = first.weight, second.gather_param("weight")
        x = torch.randn(6, in_f, generator=torch.Generator().manual_seed(3))
        y = comm.all_gather_dim(pair(x).detach(), -1, layer.tp_group)
    else:
        assert isinstance(first, bd.RowParallelLinear) and isinstance(second, nn.Linear)
        w_first, w_second = first.gather_param("weight"), second.weight
        x = torch.randn(6, in_f, generator=torch.Generator().manual_seed(3))
        y = pair(ShardSpec.balanced(x.shape, 1, tp, layer.tp_rank).slice_of(x)).detach()
    return (w_second @ w_first).double(), y.double(), x.double(), lin


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_parallel_pair_is_the_truncated_svd(kind, tp):
    """Uneven at tp 3 and 4 (13 rows and 10 columns); k = min(M, N), so exact."""
    for product, y, x, lin in run_ranks(_parallel_pair, tp, kind, 13, 10, 4, tp):
        best = truncated(lin.weight, 4)
        torch.testing.assert_close(product, best, **EXACT)
        torch.testing.assert_close(y, x @ best.t() + lin.bias.double(), **EXACT)


def _svd_sharded(w, rank, tp):
    bd.init_parallel(tp=tp)
    ctx = bd.get_default_context()
    rows = ShardSpec.balanced(w.shape, 0, tp, ctx.tp_rank).slice_of(w)
    svd = sharded_svd(rows.float(), rank, ctx.tp_group, oversample=10, power_iters=2)
    u = comm.all_gather_dim(svd.U_local, 0, ctx.tp_group)
    return u.double(), svd.S.double(), svd.V.double()


@pytest.mark.parametrize("tp", [1, 3])
def test_randomised_svd_of_a_large_sharded_matrix(tp):
    """200 x 150, k = 18 < 150: close to the best rank-8 approximation, no rank holding A."""
    w, s = spectrum_matrix(200, 150, decay=0.7, seed=5)
    best_err = torch.linalg.norm(w - truncated(w, 8))
    for u, sv, v in run_ranks(_svd_sharded, tp, w, 8, tp):
        torch.testing.assert_close(sv[:8], s[:8], atol=1e-5, rtol=1e-4)
        approx = (u[:, :8] * sv[:8]) @ v[:, :8].t()
        assert torch.linalg.norm(w - approx) <= 1.01 * best_err
        torch.testing.assert_close(u.t() @ u, torch.eye(u.shape[1], dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("energy", [0.3, 0.5, 0.9, 0.99, 1.0])
def test_energy_picks_the_smallest_rank_reaching_it(energy):
    lin = _dense(40, 30)
    s = torch.linalg.svdvals(lin.weight.double())
    kept = torch.cumsum(s**2, 0) / (s**2).sum()
    expected = int(torch.nonzero(kept >= energy * (1 - 1e-6))[0]) + 1
    assert bd.low_rank(lin, energy=energy).rank == expected


def _count_reduced(kind, tp):
    bd.init_parallel(tp=tp)
    lin = _dense(24, 20)
    cls = bd.ColumnParallelLinear if kind == "column" else bd.RowParallelLinear
    layer = cls.from_dense(lin)
    pair = bd.low_rank(layer, rank=3)
    counts = []
    for module in (layer, pair):
        width = 20 if kind == "column" else layer.partition_size
        x = torch.randn(5, width, requires_grad=True)
        with bd.count_collectives() as seen:
            module(x).sum().backward()
        # fp32 elements of each all-reduce issued
        counts.append([n // 4 for phase, what, n in seen.events if phase == "issue" and what == "all_reduce"])
    return counts


@pytest.mark.parametrize("kind", ["column", "row"])
def test_pair_needs_no_more_communication(kind):
    """Same number of collectives, each of r = 3 features instead of in (column) or out (row)."""
    for original, pair in run_ranks(_count_reduced, 2, kind, 2):
        assert len(pair) == len(original) == 1
        assert pair[0] == 5 * 3 < original[0]


def test_bad_requests_name_the_value():
    lin = nn.Linear(10, 6)
    for kwargs, message in [
        ({"rank": 0}, r"rank must be an integer in \[1, 6\].*got 0"),
        ({"rank": 7}, r"rank must be an integer in \[1, 6\].*got 7"),
        ({"energy": 0.0}, r"energy must be in \(0, 1\], got 0.0"),
        ({"energy": 1.5}, r"energy must be in \(0, 1\], got 1.5"),
        ({}, "give exactly one of rank= and energy="),
        ({"rank": 2, "energy": 0.5}, "give exactly one of rank= and energy="),
    ]:
        with pytest.raises(ValueError, match=message):
            bd.low_rank(lin, **kwargs)
    with pytest.raises(TypeError, match="ParallelClassifierHead"):
        bd.low_rank(bd.ParallelClassifierHead(8, 20), rank=2)
    with pytest.raises(TypeError, match="Conv2d"):
        bd.low_rank(nn.Conv2d(3, 3, 1), rank=1)
