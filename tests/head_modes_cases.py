"""The classifier head's modes with checks off (no host sync), shared by two test files:
tests/test_head_modes.py runs them on the head's CPU loop, tests/test_head_kernels.py on its GPU loop
(the Triton kernels, interpreted on CPU). Every mode counted for host syncs, and padded (a world
head's DP blocks, a sample's capacity) against the same head with checks on. The rank functions are
module-level so that run_ranks can start them in its ranks; the tokens, heads and tolerances they use
are here too."""
import math

import torch

import bigdense as bd
from bigdense.testing.counters import OpCounter
from helpers import assert_close

D, C = 8, 37  # 37 classes: uneven over 2 and 4 ranks
# fp32 with padding: the same per-token math, but the weight gradient sums the tokens in other
# chunks (padding rows shift the chunk boundaries) -- a few ulps of values of size ~1.
FP32 = dict(rtol=1e-5, atol=1e-5)
# Margin heads at scale 64: logits of size ~64, summed in another order (see head_xc_cases.py).
MARGIN = dict(rtol=1e-4, atol=1e-4)
MODES = {
    "tp": dict(),
    "tp sampled": dict(sample_rate=0.3),
    "world": dict(shard="world"),
    "world sampled cosface": dict(shard="world", sample_rate=0.3, margin="cosface", bias=False),
    "world arcface": dict(shard="world", margin="arcface", bias=False),
}


def rank_tokens(dp_rank: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed + dp_rank)
    h = torch.randn(n, D, generator=g)
    target = torch.randint(0, C, (n,), generator=g)
    if n > 2:
        target[1] = -100
    return h, target


def mode_head(options, tp):
    torch.manual_seed(0)
    return bd.ParallelClassifierHead(D, C, chunk_size=5, **options)


def loss_and_grads(head, h, target, seed, eps=0.0):
    torch.manual_seed(seed)  # the sample's seed
    x = h.clone().requires_grad_()
    loss = head.loss(x, target, label_smoothing=eps)
    loss.backward()
    grads = (loss.detach(), x.grad, head.weight.grad.clone())
    head.zero_grad(set_to_none=True)
    return grads


def syncs_per_mode(tp):
    ctx = bd.init_parallel(tp=tp)
    out = {}
    for name, options in MODES.items():
        head = mode_head(options, tp)
        h, target = rank_tokens(ctx.dp_rank, 6, 1)
        with bd.set_checks(False):
            loss_and_grads(head, h, target, 5)  # a world head's first call exchanges the DP counts once
            with OpCounter() as counted:
                loss, _, _ = loss_and_grads(head, h, target, 6)
        assert math.isfinite(float(loss)), name
        out[name] = dict(counted.sync_ops)
    return out


def padded_equals_exact(sizes, tp, eps):
    ctx = bd.init_parallel(tp=tp)
    n = sizes[ctx.dp_rank]
    for name, options in MODES.items():
        tol = MARGIN if "margin" in options else FP32
        head = mode_head(options, tp)
        big, big_target = rank_tokens(ctx.dp_rank, max(sizes), 2)
        loss_and_grads(head, big, big_target, 3, eps)  # checks on: learns the capacity (the largest count)
        h, target = rank_tokens(ctx.dp_rank, n, 4)
        exact = loss_and_grads(head, h, target, 7, eps)  # checks on: exact blocks
        with bd.set_checks(False):
            padded = loss_and_grads(head, h, target, 7, eps)  # padded to the capacity
        for what, a, b in zip(("loss", "grad h", "grad W"), padded, exact):
            assert_close(a, b, f"{name} eps={eps} sizes={sizes}: {what}", **tol)
        if head.shard == "world" or head.sample_rate < 1.0 and ctx.dp_size > 1:
            assert head._dp_blocks.capacity == max(sizes), name
