import pytest
import torch

from bigdense.parallel import comm
from bigdense.parallel.sharding import ShardSpec, shard_range, shard_sizes


@pytest.mark.parametrize("total,parts", [(10, 4), (8, 4), (3, 4), (1, 1), (4097, 3), (0, 2)])
def test_shard_sizes_balanced_and_consistent_with_ranges(total, parts):
    sizes = shard_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra rows go to the first ranks
    start = 0
    for rank, size in enumerate(sizes):
        assert shard_range(total, parts, rank) == (start, start + size)
        start += size


def test_shard_spec_places_every_rank():
    full = torch.arange(10 * 3).view(10, 3)
    pieces = [ShardSpec.balanced((10, 3), 0, 4, r).slice_of(full) for r in range(4)]
    assert [p.shape[0] for p in pieces] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(pieces), full)


def test_single_rank_collectives_are_identities():
    x = torch.randn(3, 5)
    assert comm.all_gather_dim(x, -1, None) is x
    assert comm.split_dim(x, -1, None) is x
    assert comm.all_reduce_(x, None) is x
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
