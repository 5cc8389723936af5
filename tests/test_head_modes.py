"""Every classifier-head mode without a host sync (checks off), and what makes that possible: a world
head's DP ranks padded to a capacity fixed by an earlier exchange, a sample padded to a static
capacity with its count on the device, and the NaN (never a wrong loss) when a sample would overflow.
References are the same head with checks on (exact DP blocks, every count read on the host) and the
full-logits reference of helpers.py."""
import math

import pytest

import bigdense as bd
from bigdense.layers.head import sampling
from bigdense.testing import run_ranks
from head_modes_cases import MODES, loss_and_grads, mode_head, padded_equals_exact, rank_tokens, syncs_per_mode


@pytest.mark.parametrize("tp", [1, 2])  # on 2 processes: tp=1 x dp=2 (world heads shard over DP), tp=2
def test_every_head_mode_makes_no_host_sync_with_checks_off(tp):
    for rank in run_ranks(syncs_per_mode, 2, tp):
        assert rank == {name: {} for name in MODES}, rank


@pytest.mark.parametrize("sizes,tp,eps", [((7, 3), 1, 0.0), ((0, 5), 1, 0.1), ((6, 6), 2, 0.1)])
def test_checks_off_padding_gives_the_exact_loss_and_gradients(sizes, tp, eps):
    # DP ranks holding different numbers of tokens (one holding none): with checks off each pads to
    # the capacity learned with checks on; the padding rows must change nothing.
    run_ranks(padded_equals_exact, 2, sizes, tp, eps)


def _more_tokens_than_the_capacity():
    bd.init_parallel(tp=1)
    head = mode_head(dict(shard="world"), 1)
    with bd.set_checks(False):
        loss_and_grads(head, *rank_tokens(0, 4, 1), 1)
        with pytest.raises(ValueError, match=r"ParallelClassifierHead\(in_features=8, num_classes=37, "
                                             r".*\): 9 tokens on this rank, more than the 4 every DP rank pads to"):
            head.loss(*rank_tokens(0, 9, 1))


def test_more_tokens_than_the_capacity_with_checks_off_is_named():
    # Both ranks grow their batch at once, so both raise before any collective (no deadline wait).
    run_ranks(_more_tokens_than_the_capacity, 2)


def _overflow(monkeypatch_capacity):
    ctx = bd.init_parallel(tp=2)
    sampling.sample_capacity = monkeypatch_capacity
    head = mode_head(dict(sample_rate=0.9), 2)
    loss, grad_h, grad_w = loss_and_grads(head, *rank_tokens(0, 6, 1), 1)
    return ctx.tp_rank, float(loss), bool(grad_h.isnan().any()), bool(grad_w.isnan().any())


def test_a_sample_larger_than_its_capacity_gives_nan_on_every_rank():
    # A 90% sample of 18-19 classes per rank cannot fit in 3 rows: the loss (and so the step) must
    # be NaN on every rank -- never a loss over a truncated sample.
    for rank, loss, h_nan, w_nan in run_ranks(_overflow, 2, lambda classes, rate, tokens: 3):
        assert math.isnan(loss) and h_nan and w_nan, (rank, loss)


def test_sample_capacity_holds_every_target_and_seven_sigmas():
    assert sampling.sample_capacity(100, 1.0, 10) == 100
    assert sampling.sample_capacity(20, 0.5, 4) == 20  # a small shard keeps room for every class
    cap = sampling.sample_capacity(500_000, 0.1, 4096)
    # D distinct targets here: D rows plus Binomial(500,000 - D, 0.1) others. Every D up to the
    # batch's 4,096 stays 7 of its own sigmas below the capacity; and the capacity is no more than
    # the worst case (D = 4,096) needs, plus 9 for the rounding and the spread's +7.
    for d in (0, 1, 1000, 4096):
        mean, sigma = d + 0.1 * (500_000 - d), math.sqrt((500_000 - d) * 0.1 * 0.9)
        assert mean + 7 * sigma <= cap, d
    assert cap <= 4096 + 0.1 * (500_000 - 4096) + 7 * math.sqrt(500_000 * 0.1 * 0.9) + 9
