"""Initialisation does not depend on the TP size, uses global fans, and never builds the full
matrix for element-wise schemes, which are drawn with a fixed number of ops. Comparisons are bit-exact (torch.equal / identical hashes): the
same draws, merely distributed differently, must give the same bits."""
import hashlib
import math

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.testing.counters import OpCounter
from bigdense.layers.init import INITIALIZERS, Initializer, init_bias_
from bigdense.parallel import random as prng
from bigdense.testing import run_ranks

# Larger than one 512x512 tile in both dims, and uneven for tp = 3 and 4.
OUT, IN = 1030, 522


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _build_all(group=None):
    """Every named initializer on a Column and a Row layer, same seed each; full weights' digests."""
    out = {}
    for name in sorted(INITIALIZERS):
        for cls in (bd.ColumnParallelLinear, bd.RowParallelLinear):
            torch.manual_seed(1234)
            layer = cls(IN, OUT, init=name, tp_group=group)
            dense = layer.to_dense()
            out[(name, cls.__name__)] = (_digest(dense.weight), _digest(dense.bias))
    torch.manual_seed(7)
    custom = bd.ColumnParallelLinear(IN, OUT, init=lambda w: nn.init.normal_(w, std=0.02), tp_group=group)
    out[("custom", "ColumnParallelLinear")] = (_digest(custom.to_dense().weight), None)
    return out


def _build_all_in_ranks(tp):
    ctx = bd.init_parallel(tp=tp)
    return _build_all(ctx.tp_group)


def test_full_weight_is_bit_identical_at_tp_1_2_3_4():
    reference = _build_all()  # one process, no process group
    for tp in (1, 2, 3, 4):
        for rank, digests in enumerate(run_ranks(_build_all_in_ranks, tp, tp)):
            mismatched = [key for key in reference if digests[key] != reference[key]]
            assert not mismatched, f"tp={tp} rank {rank}: full weights differ from tp=1 for {mismatched}"


T2 = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]

# Each law as (expected std, largest magnitude it allows, smallest largest-magnitude it must reach),
# from the *global* fans fan_in = IN, fan_out = OUT. Uniform laws reach their bound; normals
# truncated at 2 sigma reach 2 sigma; plain normals of ~540k samples reach 4 sigma.
LAWS = {
    "torch": (1 / math.sqrt(3 * IN), 1 / math.sqrt(IN), 1 / math.sqrt(IN)),
    "xavier_uniform": (math.sqrt(2 / (IN + OUT)), math.sqrt(6 / (IN + OUT)), math.sqrt(6 / (IN + OUT))),
    "xavier_normal": (math.sqrt(2 / (IN + OUT)), math.inf, 4 * math.sqrt(2 / (IN + OUT))),
    "kaiming_uniform": (math.sqrt(2 / IN), math.sqrt(6 / IN), math.sqrt(6 / IN)),
    "kaiming_normal": (math.sqrt(2 / IN), math.inf, 4 * math.sqrt(2 / IN)),
    "lecun_normal": (1 / math.sqrt(IN), 2 / T2 / math.sqrt(IN), 2 / T2 / math.sqrt(IN)),
    "trunc_normal": (0.02 * T2, 0.04, 0.04),
    "normal": (1.0, math.inf, 4.0),
}


def _law_stats(tp):
    """(mean, std, max |w|) of every full weight, and max |W^T W - I| for orthogonal, built at ``tp``."""
    ctx = bd.init_parallel(tp=tp)
    out = {}
    for name in sorted(INITIALIZERS):
        for cls in (bd.ColumnParallelLinear, bd.RowParallelLinear):  # split along fan_out, along fan_in
            torch.manual_seed(0)
            w = cls(IN, OUT, init=name, tp_group=ctx.tp_group).to_dense().weight.detach().double()
            ortho = (w.t() @ w - torch.eye(IN, dtype=w.dtype)).abs().max().item() if name == "orthogonal" else None
            out[(name, cls.__name__)] = (w.mean().item(), w.std().item(), w.abs().max().item(), ortho)
    return out


def test_each_initializer_follows_its_law_with_global_fans_at_tp3():
    # At tp=3 a shard's fans would be a third of the global ones: a law computed from them misses
    # the std by 40% or more. With ~540k samples the empirical std is within ~0.1% of the true one
    # and the mean within ~0.002 std of 0, so 1% (std) and 0.01 std (mean) leave room; the largest
    # magnitude of a uniform law or a 2-sigma truncation lies within 0.1% of its bound.
    for rank, stats in enumerate(run_ranks(_law_stats, 3, 3)):
        for (name, kind), (mean, std, largest, ortho) in stats.items():
            where = f"rank {rank} {kind} init={name}: mean={mean:.3g} std={std:.6g} max={largest:.6g}"
            if name == "zeros":
                assert std == 0.0 and largest == 0.0, where
            elif name == "orthogonal":
                assert ortho < 1e-5, f"{where}: |W^T W - I| = {ortho}"  # fp32 QR: 5e-7
            else:
                expected_std, upper, lower = LAWS[name]
                assert abs(std - expected_std) <= 0.01 * expected_std, f"{where}; expected std {expected_std:.6g}"
                assert abs(mean) <= 0.01 * expected_std, where
                assert 0.999 * lower <= largest <= upper * (1 + 1e-6), f"{where}; expected max in [{lower}, {upper}]"


def test_meta_device_build_then_materialize_equals_eager_build():
    torch.manual_seed(3)
    eager = nn.Sequential(bd.ColumnParallelLinear(IN, 64), bd.RowParallelLinear(64, 8, init="xavier_normal"))
    torch.manual_seed(3)
    lazy = nn.Sequential(
        bd.ColumnParallelLinear(IN, 64, device="meta"), bd.RowParallelLinear(64, 8, init="xavier_normal", device="meta")
    )
    assert lazy[0].weight.is_meta
    bd.materialize(lazy, "cpu")
    for a, b in zip(eager.parameters(), lazy.parameters()):
        assert torch.equal(a, b)
    assert lazy[0].weight.tensor_model_parallel and lazy[0].weight.partition_dim == 0


def _init_ops(name: str, rows: int, cols: int) -> int:
    """aten ops of one init (on the meta device: the ops and CHUNK of an accelerator, none run)."""
    with OpCounter() as counter:
        INITIALIZERS[name].init_(torch.empty(rows, cols, device="meta"), (rows, cols), (0, 0), seed=11)
    return counter.ops


def test_named_init_ops_do_not_grow_with_the_tensor():
    # A 512-tile loop would launch 4 vs 64 tiles' worth of kernels for these shards (both within one
    # CHUNK); counter-based drawing launches the same fixed handful for both.
    assert 1024 * 1024 < 4096 * 4096 <= prng.CHUNK
    for name in sorted(set(INITIALIZERS) - {"orthogonal"}):
        small, large = _init_ops(name, 1024, 1024), _init_ops(name, 4096, 4096)
        assert small == large and small <= 40, (name, small, large)
    with OpCounter() as counter:
        init_bias_(torch.empty(5000), INITIALIZERS["torch"], 64, 9000, 3000, seed=11)
    assert counter.ops <= 30, counter.by_op
    # Past CHUNK the shard is drawn in CHUNK-sized blocks: the count grows with size / CHUNK only.
    blocks = 8192 * 8192 // prng.CHUNK
    assert blocks > 1 and _init_ops("normal", 8192, 8192) <= blocks * _init_ops("normal", 1024, 1024)


def test_chunked_draws_equal_unchunked_draws(monkeypatch):
    full = INITIALIZERS["xavier_normal"].init_(torch.empty(300, 70), (300, 70), (0, 0), seed=5)
    monkeypatch.setattr(prng, "CPU_CHUNK", 1000)  # 14 rows a block; and 1-column blocks below
    assert torch.equal(INITIALIZERS["xavier_normal"].init_(torch.empty(300, 70), (300, 70), (0, 0), seed=5), full)
    monkeypatch.setattr(prng, "CPU_CHUNK", 1)
    part = INITIALIZERS["xavier_normal"].init_(torch.empty(7, 9), (300, 70), (100, 20), seed=5)
    assert torch.equal(part, full[100:107, 20:29])


def test_counter_draws_have_the_law_statistics_and_no_neighbour_correlation():
    # 4M samples: the sample mean has std sigma / 2048, the sample std (relative) ~ 1/2900, and the
    # correlation of independent pairs ~ 1/2048 (the relative error of the std is largest for a
    # normal, whose kurtosis is the largest of the three). 5 of those standard errors almost never fail by
    # chance; a correlation from the row/column hash structure would show far above them.
    n = 2048
    for name, std in (("normal", 1.0), ("torch", 1 / math.sqrt(3 * n)), ("trunc_normal", 0.02 * T2)):
        w = INITIALIZERS[name].init_(torch.empty(n, n), (n, n), (0, 0), seed=99).double()
        assert abs(w.mean().item()) < 5 * std / n, name
        assert abs(w.std().item() / std - 1) < 5 / math.sqrt(2 * n * n), (name, w.std().item(), std)
        z = (w - w.mean()) / w.std()
        for a, b in ((z[:, 1:], z[:, :-1]), (z[1:], z[:-1]), (z[1:, 1:], z[:-1, :-1]), (z[1:, :-1], z[:-1, 1:])):
            assert abs((a * b).mean().item()) < 5 / n, name


def _generated_elements(tp):
    ctx = bd.init_parallel(tp=tp)
    counts = []

    def counting(tile, generator, fan_in, fan_out):
        counts.append(tile.numel())
        tile.normal_(generator=generator)

    sizes = {}
    for cls in (bd.ColumnParallelLinear, bd.RowParallelLinear):
        counts.clear()
        layer = cls(4000, 4000, bias=False, init=Initializer("counting", counting), tp_group=ctx.tp_group)
        sizes[cls.__name__] = (sum(counts), max(counts), layer.weight.numel())
    return sizes


def test_generator_based_init_generates_only_the_tiles_of_its_own_shard():
    # An Initializer built from a generator-based fill keeps the tile path (`tiled_fill_`).
    for rank, sizes in enumerate(run_ranks(_generated_elements, 4, 4)):
        for kind, (generated, largest_tile, local) in sizes.items():
            # A shard of 1000 rows/cols touches at most 3 tiles of 512 along the split dim.
            assert local <= generated <= 3 * 512 * 4000, (kind, rank, generated)
            assert largest_tile <= 512 * 512 and generated < 4000 * 4000 / 2


def test_init_errors_name_the_layer_and_the_choices():
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(4, 8\): unknown init 'gaussian'; expected one of \["):
        bd.ColumnParallelLinear(4, 8, init="gaussian")
    with pytest.raises(ValueError, match="pass init='xavier_uniform' instead"):
        bd.RowParallelLinear(4, 8, init=nn.init.xavier_uniform_)
