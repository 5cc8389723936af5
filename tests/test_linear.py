"""Column/Row parallel linear layers against the unsharded nn.Linear, at tp = 1, 2, 3, 4.

Tolerance: torch's defaults for fp32 (rtol 1.3e-6, atol 1e-5). A sharded layer performs the same
multiply-adds as nn.Linear, but in a different order (BLAS blocks a narrower matrix differently;
RowParallel sums partial products over ranks), which moves results by a few ulps. With at most 24
terms of unit scale per sum that stays far below 1e-5; a wrong slice or a missing reduction is off
by O(1).
"""
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.parallel.sharding import shard_range
from bigdense.testing import run_ranks

from helpers import assert_close

TOL = dict(rtol=1.3e-6, atol=1e-5)
LEADING = [(5,), (2, 3), ()]  # leading dims of the input, () is a 1-D input
SIZES = [(16, 24), (16, 13), (13, 16), (3, 2)]  # (in, out); 13 and 2 are uneven for tp 2, 3, 4


def _case(tp_rank, tp, kind, in_f, out_f, lead, bias, option, group):
    dense = nn.Linear(in_f, out_f, bias=bias)
    x_full = torch.randn(*lead, in_f)
    grad_out = torch.randn(*lead, out_f)
    x_ref = x_full.clone().requires_grad_()
    y_ref = dense(x_ref)
    (y_ref * grad_out).sum().backward()

    name = f"{kind}(in={in_f}, out={out_f}, lead={lead}, bias={bias}, option={option}, tp={tp}, rank={tp_rank})"
    if kind == "column":
        layer = bd.ColumnParallelLinear.from_dense(dense, gather_output=option, tp_group=group)
        lo, hi = shard_range(out_f, tp, tp_rank)
        x = x_full.clone().requires_grad_()
        y = layer(x)
        y_expected = y_ref if option else y_ref[..., lo:hi]
        g = grad_out if option else grad_out[..., lo:hi]
        w_grad, b_grad = dense.weight.grad[lo:hi], (dense.bias.grad[lo:hi] if bias else None)
    else:
        layer = bd.RowParallelLinear.from_dense(dense, input_is_parallel=option, tp_group=group)
        lo, hi = shard_range(in_f, tp, tp_rank)
        x = (x_full[..., lo:hi] if option else x_full).clone().requires_grad_()
        y = layer(x)
        y_expected, g = y_ref, grad_out
        w_grad, b_grad = dense.weight.grad[:, lo:hi], (dense.bias.grad if bias else None)
    (y * g).sum().backward()

    assert_close(y, y_expected.detach(), f"{name} output", **TOL)
    x_grad_expected = x_ref.grad[..., lo:hi] if (kind == "row" and option) else x_ref.grad
    assert_close(x.grad, x_grad_expected, f"{name} input grad", **TOL)
    assert_close(layer.weight.grad, w_grad, f"{name} weight grad", **TOL)
    if bias:
        assert_close(layer.bias.grad, b_grad, f"{name} bias grad", **TOL)


def _all_cases(tp):
    ctx = bd.init_parallel(tp=tp)
    n = 0
    for kind, (in_f, out_f), lead, bias, option in itertools.product(
        ("column", "row"), SIZES, LEADING, (True, False), (False, True)
    ):
        torch.manual_seed(n)  # same weights and inputs on every rank
        _case(ctx.tp_rank, tp, kind, in_f, out_f, lead, bias, option, ctx.tp_group)
        n += 1
    return n


def _mlp_pair(tp):
    """Column -> GELU -> Row splits the hidden size identically on both sides, even when uneven."""
    ctx = bd.init_parallel(tp=tp)
    for hidden in (12, 13, 5):
        torch.manual_seed(hidden)
        fc1, fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 6)
        x = torch.randn(4, 7, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        col = bd.ColumnParallelLinear.from_dense(fc1, tp_group=ctx.tp_group)
        row = bd.RowParallelLinear.from_dense(fc2, tp_group=ctx.tp_group)
        assert col.partition_sizes == row.partition_sizes
        y = row(F.gelu(col(x)))
        y_ref = fc2(F.gelu(fc1(x_ref)))
        y.square().sum().backward()
        y_ref.square().sum().backward()
        assert_close(y, y_ref.detach(), f"mlp hidden={hidden} output", **TOL)
        assert_close(x.grad, x_ref.grad, f"mlp hidden={hidden} input grad", **TOL)
        dense1, dense2 = col.to_dense(), row.to_dense()
        assert torch.equal(dense1.weight, fc1.weight) and torch.equal(dense2.weight, fc2.weight)
        assert torch.equal(dense1.bias, fc1.bias) and torch.equal(dense2.bias, fc2.bias)
    return True


def test_linear_layers_match_nn_linear_at_every_tp_size():
    for tp in (1, 2, 3, 4):
        counts = run_ranks(_all_cases, tp, tp)
        assert counts == [len(SIZES) * len(LEADING) * 8] * tp


def test_column_row_pair_matches_the_dense_mlp():
    for tp in (2, 3):
        assert all(run_ranks(_mlp_pair, tp, tp))


def test_layers_work_without_any_process_group():
    torch.manual_seed(0)
    col, row = bd.ColumnParallelLinear(8, 12, gather_output=True), bd.RowParallelLinear(12, 4, input_is_parallel=False)
    assert col.tp_size == 1 and col.tp_group is None and col.weight.shape == (12, 8)
    x = torch.randn(3, 8)
    fc1, fc2 = torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)  # nn.Linear with the layers' (whole) weights
    with torch.no_grad():
        for fc, layer in ((fc1, col), (fc2, row)):
            fc.weight.copy_(layer.weight)
            fc.bias.copy_(layer.bias)
    assert torch.equal(col(x), fc1(x))
    assert torch.equal(row(col(x)), fc2(fc1(x)))


def test_from_dense_keeps_device_dtype_and_repr():
    dense = nn.Linear(6, 4, dtype=torch.float64)
    layer = bd.ColumnParallelLinear.from_dense(dense)
    assert layer.weight.dtype == torch.float64 and torch.equal(layer.weight, dense.weight)
    assert "out_features=4" in repr(layer) and "tp=1" in repr(layer)
