"""Counter-based tp_dropout: layout-free masks, a fixed number of ops, no host sync, good statistics."""
import math

import pytest
import torch

import bigdense as bd
from bigdense.testing.counters import OpCounter
from bigdense.parallel.dropout import keep_mask


def _mask(x, p, seed, **kw):
    torch.manual_seed(seed)
    return bd.tp_dropout(torch.ones_like(x), p, True, **kw) != 0


@pytest.mark.parametrize("splits", [[4], [2, 2], [3, 1], [1, 1, 1, 1]])
def test_a_head_shard_applies_exactly_its_slice_of_the_unsharded_mask(splits):
    x = torch.ones(2, 4, 6, 6)  # (batch, heads, query, key): heads sharded as attention does
    full = _mask(x, 0.3, seed=5, shard_dim=1, global_size=4)
    start = 0
    for n in splits:
        shard = _mask(x[:, start : start + n], 0.3, seed=5, shard_dim=1, global_size=4, offset=start)
        assert torch.equal(shard, full[:, start : start + n]), (splits, start)
        start += n


def test_data_parallel_ranks_apply_their_rows_of_the_global_batch_mask():
    x = torch.ones(8, 5, 3)
    full = _mask(x, 0.5, seed=9)
    for dp, rank in ((2, 0), (2, 1), (4, 3)):
        rows = 8 // dp
        with bd.batch_slice(rank * rows, 8):
            mine = _mask(x[rank * rows : (rank + 1) * rows], 0.5, seed=9)
        assert torch.equal(mine, full[rank * rows : (rank + 1) * rows]), (dp, rank)
    # Both at once: a DP rank's rows of a TP rank's column shard.
    full = _mask(x, 0.5, seed=9, shard_dim=-1, global_size=3)
    with bd.batch_slice(4, 8):
        mine = _mask(x[4:, :, 1:], 0.5, seed=9, shard_dim=-1, global_size=3, offset=1)
    assert torch.equal(mine, full[4:, :, 1:])


def test_shards_below_and_across_2_31_agree_with_the_wider_range_they_belong_to():
    # Indices past int32 hash with a second (wide) word rule. Each index's word depends on the index
    # alone, so a shard ending below 2^31 and one crossing it give their common columns and rows the
    # same words: here [2^31 - 4, 2^31) alone vs inside [2^31 - 4, 2^31 + 4).
    x = torch.ones(3, 8)
    start = 2**31 - 4
    across = _mask(x, 0.5, seed=7, shard_dim=-1, global_size=2**31 + 8, offset=start)
    below = _mask(x[:, :4], 0.5, seed=7, shard_dim=-1, global_size=2**31 + 8, offset=start)
    assert torch.equal(below, across[:, :4])
    key = torch.tensor([11, -5], dtype=torch.int32)
    rows_across, rows_below = keep_mask(key, (start, 8), (0, 5), 0.5, "cpu"), keep_mask(key, (start, 4), (0, 5), 0.5, "cpu")
    assert torch.equal(rows_below, rows_across[:4])
    assert 0 < across.float().mean() < 1 and not torch.equal(across[:, :4], across[:, 4:])  # not degenerate


def test_op_count_does_not_grow_with_the_tensor_and_nothing_syncs():
    counts = []
    for shape in ((4, 16), (8, 12, 256, 256)):
        x = torch.randn(shape, requires_grad=True)
        with OpCounter() as counter:
            bd.tp_dropout(x, 0.1, shard_dim=1, global_size=shape[1]).sum().backward()
        assert counter.syncs == 0, counter.sync_ops
        counts.append(counter.ops)
    assert counts[0] == counts[1] and counts[0] < 50, counts


def test_inverted_scaling_and_a_bad_shard_is_named():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    y = bd.tp_dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    with pytest.raises(ValueError, match="does not fit in global_size=4"):
        bd.tp_dropout(torch.ones(2, 3), 0.1, shard_dim=1, global_size=4, offset=2)


# Statistics on 10^7 draws. Each bound is 4 standard deviations of the statistic under
# independent Bernoulli(1 - p) draws (sd of a rate: sqrt(p(1-p)/n); of a correlation: 1/sqrt(n)),
# so a correct generator fails one check with probability ~6e-5; the seeds are fixed anyway.
N_ROWS, N_COLS = 2500, 4000


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_4_sigma_on_ten_million_draws(p):
    keep = keep_mask(torch.tensor([123456789, -5], dtype=torch.int32), (0, N_ROWS), (0, N_COLS), p, "cpu")
    n = keep.numel()
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n), rate


def _corr(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_no_correlation_between_neighbouring_elements_rows_or_consecutive_seeds():
    p = 0.5
    torch.manual_seed(1000)
    first, second = bd.parallel.dropout.draw_dropout_key(), bd.parallel.dropout.draw_dropout_key()
    torch.manual_seed(1001)
    next_seed = bd.parallel.dropout.draw_dropout_key()
    keep = keep_mask(first, (3, N_ROWS), (10**9, N_COLS), p, "cpu")
    bound = lambda a: 4 / math.sqrt(a.numel())  # noqa: E731
    for what, a, b in (
        ("neighbouring elements", keep[:, :-1], keep[:, 1:]),
        ("neighbouring rows", keep[:-1], keep[1:]),
        ("elements two apart", keep[:, :-2], keep[:, 2:]),
        ("consecutive calls", keep, keep_mask(second, (3, N_ROWS), (10**9, N_COLS), p, "cpu")),
        ("consecutive manual_seed values", keep, keep_mask(next_seed, (3, N_ROWS), (10**9, N_COLS), p, "cpu")),
        ("row r vs column r (transposed indices)", keep[:, :N_ROWS],
         keep_mask(first, (0, N_ROWS), (0, N_ROWS), p, "cpu").t()),
    ):
        assert abs(_corr(a, b)) < bound(a), (what, _corr(a, b))
    # Indices past 2^32 are distinct counters too (the high word is mixed in).
    low = keep_mask(torch.tensor([1, 1], dtype=torch.int32), (0, 1), (5, 4096), p, "cpu")
    high = keep_mask(torch.tensor([1, 1], dtype=torch.int32), (0, 1), (5 + 2**32, 4096), p, "cpu")
    assert not torch.equal(low, high)
