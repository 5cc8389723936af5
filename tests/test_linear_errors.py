"""Bad input to the linear layers: an error that names the layer, what it expected and what came."""
import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.testing import RankError, run_ranks


def test_wrong_last_dimension():
    layer = bd.ColumnParallelLinear(8, 4)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(in_features=8, out_features=4, tp=1, rank 0\): expected input of shape \(\*, 8\).*got \(3, 7\)"):
        layer(torch.randn(3, 7))


def _row_given_full_width():
    ctx = bd.init_parallel(tp=2)
    layer = bd.RowParallelLinear(10, 4, tp_group=ctx.tp_group)
    layer(torch.randn(3, 10))  # the full width, but input_is_parallel=True wants 5


def test_row_with_full_width_input_when_a_shard_was_expected_fails_at_tp2():
    with pytest.raises(RankError, match=r"(?s)RowParallelLinear\(in_features=10, out_features=4, tp=2, rank \d\): expected input of shape \(\*, 5\) \(this rank's slice of in_features=10"):
        run_ranks(_row_given_full_width, 2, timeout=60)


def test_row_with_unsplit_input_checks_the_full_width():
    layer = bd.RowParallelLinear(10, 4, input_is_parallel=False)
    with pytest.raises(ValueError, match=r"expected input of shape \(\*, 10\) \(in_features, input_is_parallel=False\), got \(2, 5\)"):
        layer(torch.randn(2, 5))


def test_dtype_mismatch_names_both_dtypes_but_autocast_is_allowed():
    layer = bd.ColumnParallelLinear(8, 4)
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match parameter dtype torch.float32"):
        layer(torch.randn(2, 8, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_device_mismatch():
    layer = bd.RowParallelLinear(8, 4, input_is_parallel=False)
    with pytest.raises(ValueError, match="input is on meta but the layer's parameters are on cpu"):
        layer(torch.empty(2, 8, device="meta"))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: in_features must be a positive integer"):
        bd.ColumnParallelLinear(bad, 4)


def test_from_dense_rejects_other_modules_and_conflicting_options():
    with pytest.raises(TypeError, match=r"RowParallelLinear.from_dense: expected an nn.Linear, got Conv1d"):
        bd.RowParallelLinear.from_dense(nn.Conv1d(2, 2, 1))
    with pytest.raises(TypeError, match="init= comes from the nn.Linear"):
        bd.ColumnParallelLinear.from_dense(nn.Linear(2, 2), init="zeros")


def test_non_tensor_input():
    with pytest.raises(TypeError, match="expected a tensor input, got list"):
        bd.ColumnParallelLinear(2, 2)([1.0, 2.0])
