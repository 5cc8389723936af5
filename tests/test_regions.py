"""The four communication regions against what each collective means, with uneven shards.

Every value here is a small integer-valued float, so sums are exact and all checks are equality.
"""
import torch

import bigdense as bd
from bigdense.parallel import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from bigdense.parallel.sharding import shard_range, shard_sizes
from bigdense.testing import run_ranks


def _regions(tp):
    ctx = bd.init_parallel(tp=tp)
    for width in (8, 7, 3):  # even for tp=2/4, uneven for 3; 3 < tp=4 leaves one rank empty
        _check_regions(ctx.tp_rank, ctx.tp_group, tp, width)
    # Shards that no balanced split would produce: widths 1 and 3 on two ranks.
    if tp == 2:
        x = torch.arange(6.0).view(2, 3)[:, : 1 + 2 * ctx.tp_rank].clone().requires_grad_()
        y = gather_from_tp(x, ctx.tp_group)
        assert y.shape == (2, 4)
        y.backward(torch.arange(8.0).view(2, 4))
        expected = torch.arange(8.0).view(2, 4)[:, :1] if ctx.tp_rank == 0 else torch.arange(8.0).view(2, 4)[:, 1:]
        assert torch.equal(x.grad, expected)
    return True


def _check_regions(r, g, tp, width):
    sizes = shard_sizes(width, tp)
    lo, hi = shard_range(width, tp, r)
    full = torch.arange(2 * 3 * width, dtype=torch.float32).view(2, 3, width)

    # copy: forward identity; backward sums the grads of all ranks.
    x = full.clone().requires_grad_()
    y = copy_to_tp(x, g)
    assert torch.equal(y, full)
    (y * (r + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full_like(full, sum(range(1, tp + 1))))

    # reduce: forward sums the per-rank values; backward passes the grad through unchanged.
    x = (full * (r + 1)).requires_grad_()
    y = reduce_from_tp(x, g)
    assert torch.equal(y, full * sum(range(1, tp + 1)))
    y.backward(torch.ones_like(y) * 7)
    assert torch.equal(x.grad, torch.full_like(full, 7.0))

    # gather: forward concatenates the uneven last-dim shards; backward keeps this rank's slice.
    x = full[..., lo:hi].clone().requires_grad_()
    y = gather_from_tp(x, g, sizes)
    assert torch.equal(y, full)
    y.backward(full * 2)
    assert torch.equal(x.grad, full[..., lo:hi] * 2)
    # Without sizes, the shard widths are exchanged first, and the backward splits the same way.
    x = full[..., lo:hi].clone().requires_grad_()
    y = gather_from_tp(x, g)
    assert torch.equal(y, full)
    y.backward(full * 3)
    assert torch.equal(x.grad, full[..., lo:hi] * 3)

    # scatter: forward keeps this rank's slice; backward gathers every rank's grad slice.
    x = full.clone().requires_grad_()
    y = scatter_to_tp(x, g, sizes)
    assert torch.equal(y, full[..., lo:hi])
    y.backward(full[..., lo:hi] + 1)
    assert torch.equal(x.grad, full + 1)


def test_regions_at_tp_2_3_4_with_even_and_uneven_widths():
    for tp in (2, 3, 4):
        assert all(run_ranks(_regions, tp, tp))


def test_regions_are_identities_without_a_process_group():
    x = torch.randn(2, 5, requires_grad=True)
    for region in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp):
        assert region(x, None) is x
