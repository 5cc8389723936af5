"""Every classifier-head mode without a host sync (checks off), and what makes that possible: a world
head's DP ranks padded to a capacity fixed by an earlier exchange, a sample padded to a static
capacity with its count on the device, and the NaN (never a wrong loss) when a sample would overflow.
References are the same head with checks on (exact DP blocks, every count read on the host) and the
full-logits reference of helpers.py."""
import math

import pytest
import torch

import bigdense as bd
from bigdense.layers.head import sampling
from bigdense.testing import run_ranks
from bigdense.testing.counters import OpCounter
from helpers import assert_close

D, C = 8, 37  # 37 classes: uneven over 2 and 4 ranks
# fp32 with padding: the same per-token math, but the weight gradient sums the tokens in other
# chunks (padding rows shift the chunk boundaries) -- a few ulps of values of size ~1.
FP32 = dict(rtol=1e-5, atol=1e-5)
# Margin heads at scale 64: logits of size ~64, summed in another order (see test_head_xc.py).
MARGIN = dict(rtol=1e-4, atol=1e-4)
MODES = {
    "tp": dict(),
    "tp sampled": dict(sample_rate=0.3),
    "world": dict(shard="world"),
    "world sampled cosface": dict(shard="world", sample_rate=0.3, margin="cosface", bias=False),
    "world arcface": dict(shard="world", margin="arcface", bias=False),
}


def _tokens(dp_rank: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed + dp_rank)
    h = torch.randn(n, D, generator=g)
    target = torch.randint(0, C, (n,), generator=g)
    if n > 2:
        target[1] = -100
    return h, target


def _head(options, tp):
    torch.manual_seed(0)
    return bd.ParallelClassifierHead(D, C, chunk_size=5, **options)


def _loss_and_grads(head, h, target, seed, eps=0.0):
    torch.manual_seed(seed)  # the sample's seed
    x = h.clone().requires_grad_()
    loss = head.loss(x, target, label_smoothing=eps)
    loss.backward()
    grads = (loss.detach(), x.grad, head.weight.grad.clone())
    head.zero_grad(set_to_none=True)
    return grads


def _syncs_per_mode(tp):
    ctx = bd.init_parallel(tp=tp)
    out = {}
    for name, options in MODES.items():
        head = _head(options, tp)
        h, target = _tokens(ctx.dp_rank, 6, 1)
        with bd.set_checks(False):
            _loss_and_grads(head, h, target, 5)  # a world head's first call exchanges the DP counts once
            with OpCounter() as counted:
                loss, _, _ = _loss_and_grads(head, h, target, 6)
        assert math.isfinite(float(loss)), name
        out[name] = dict(counted.sync_ops)
    return out


@pytest.mark.parametrize("tp", [1, 2])  # on 2 processes: tp=1 x dp=2 (world heads shard over DP), tp=2
def test_every_head_mode_makes_no_host_sync_with_checks_off(tp):
    for rank in run_ranks(_syncs_per_mode, 2, tp):
        assert rank == {name: {} for name in MODES}, rank


def _padded_equals_exact(sizes, tp, eps):
    ctx = bd.init_parallel(tp=tp)
    n = sizes[ctx.dp_rank]
    for name, options in MODES.items():
        tol = MARGIN if "margin" in options else FP32
        head = _head(options, tp)
        big, big_target = _tokens(ctx.dp_rank, max(sizes), 2)
        _loss_and_grads(head, big, big_target, 3, eps)  # checks on: learns the capacity (the largest count)
        h, target = _tokens(ctx.dp_rank, n, 4)
        exact = _loss_and_grads(head, h, target, 7, eps)  # checks on: exact blocks
        with bd.set_checks(False):
            padded = _loss_and_grads(head, h, target, 7, eps)  # padded to the capacity
        for what, a, b in zip(("loss", "grad h", "grad W"), padded, exact):
            assert_close(a, b, f"{name} eps={eps} sizes={sizes}: {what}", **tol)
        if head.shard == "world" or head.sample_rate < 1.0 and ctx.dp_size > 1:
            assert head._dp_blocks.capacity == max(sizes), name


@pytest.mark.parametrize("sizes,tp,eps", [((7, 3), 1, 0.0), ((0, 5), 1, 0.1), ((6, 6), 2, 0.1)])
def test_checks_off_padding_gives_the_exact_loss_and_gradients(sizes, tp, eps):
    # DP ranks holding different numbers of tokens (one holding none): with checks off each pads to
    # the capacity learned with checks on; the padding rows must change nothing.
    run_ranks(_padded_equals_exact, 2, sizes, tp, eps)


def _more_tokens_than_the_capacity():
    bd.init_parallel(tp=1)
    head = _head(dict(shard="world"), 1)
    with bd.set_checks(False):
        _loss_and_grads(head, *_tokens(0, 4, 1), 1)
        with pytest.raises(ValueError, match=r"ParallelClassifierHead\(in_features=8, num_classes=37, "
                                             r".*\): 9 tokens on this rank, more than the 4 every DP rank pads to"):
            head.loss(*_tokens(0, 9, 1))


def test_more_tokens_than_the_capacity_with_checks_off_is_named():
    # Both ranks grow their batch at once, so both raise before any collective (no deadline wait).
    run_ranks(_more_tokens_than_the_capacity, 2)


def _overflow(monkeypatch_capacity):
    ctx = bd.init_parallel(tp=2)
    sampling.sample_capacity = monkeypatch_capacity
    head = _head(dict(sample_rate=0.9), 2)
    loss, grad_h, grad_w = _loss_and_grads(head, *_tokens(0, 6, 1), 1)
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
