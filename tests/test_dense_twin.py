"""Every layer's trio with its plain PyTorch twin (`bigdense.layers.base.DenseTwin`), at tp = 1..3
with sizes that do not divide: ``from_dense(plain)`` computes what ``plain`` computes, ``to_dense()``
gives ``plain`` back bit for bit (a gather only copies), ``load_dense_`` round-trips; the classifier
head with ``shard="tp"`` and ``shard="world"`` (tp=2 x dp=2), with a margin and sampling.

The references are the plain torch modules themselves. Tolerances: a column layer, an embedding, a
norm or a batch norm computes each output from the same values as its twin, but the GEMM of a
slice of the weight may block its sums otherwise than the whole one's: a few ulps of fp32 (1e-6).
A row layer, an MLP and a low-rank pair sum partial products over TP, which reorders fp32
additions of O(1) terms: 1e-5.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.compression.lowrank import LowRankPair
from bigdense.layers.mlp import DenseMLP
from bigdense.testing import run_ranks
from helpers import assert_close

SLICE = dict(rtol=1e-6, atol=1e-6)  # same values, possibly another GEMM blocking
SUMMED = dict(rtol=1e-5, atol=1e-5)  # partial products summed over TP
IN, OUT, HIDDEN, VOCAB, ROWS = 5, 7, 11, 10, 6  # 7 splits 4/3 and 3/2/2, 11 6/5 and 4/4/3, 10 5/5 and 4/3/3
DEADLINE = 120  # seconds for one run_ranks: the ranks take a few seconds to start on two cores


class Conv1D(nn.Module):
    """Hugging Face's Conv1D by its interface (``nx``, ``nf``, weight ``(nx, nf)``): ``x W + b``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _randomised(module, seed):
    """``module`` with every floating-point tensor redrawn (a norm's ones and zeros are no test)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.5 + (1.0 if t.dim() == 1 else 0.0))
    return module


def _twin_equals(twin, plain, what, *, transpose=()):
    """``twin`` is ``plain``'s class (an nn.Linear for a Conv1D) holding exactly its tensors."""
    want = {k: (v.t() if k in transpose else v) for k, v in plain.state_dict().items()}
    got = twin.state_dict()
    assert list(got) == list(want), (what, list(got), list(want))
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs after to_dense"


def _trio(what, cls, plain, options, run, run_plain, tol, *, twin_type=None, transpose=()):
    """The three promises for one layer class and one plain module."""
    layer = cls.from_dense(plain, **options)
    assert_close(run(layer), run_plain(plain), f"{what}: from_dense forward", **tol)
    twin = layer.to_dense()
    assert type(twin) is (twin_type or type(plain)), (what, type(twin))
    _twin_equals(twin, plain, what, transpose=transpose)
    other = _randomised(copy.deepcopy(plain), seed=99)
    assert layer.load_dense_(other) is layer
    _twin_equals(layer.to_dense(), other, f"{what} after load_dense_", transpose=transpose)
    layer.load_dense_(*plain.state_dict().values())  # the tensors themselves, in the twin's order
    _twin_equals(layer.to_dense(), plain, f"{what} after loading the tensors back", transpose=transpose)


def _every_layer(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    x, ids, rows = _x(ROWS, IN), torch.tensor([0, 3, 9, 5, 3, 7]), _x(ROWS, HIDDEN, seed=2)

    linear = _randomised(nn.Linear(IN, OUT), 1)
    _trio("column", bd.ColumnParallelLinear, linear, {"gather_output": True}, lambda m: m(x), lambda m: m(x), SLICE)
    _trio("column, output sharded", bd.ColumnParallelLinear, linear, {}, lambda m: m(x),
          lambda m: m(x).narrow(-1, *_range(OUT, tp, ctx.tp_rank)), SLICE)
    _trio("row", bd.RowParallelLinear, linear, {"input_is_parallel": False}, lambda m: m(x), lambda m: m(x), SUMMED)
    _trio("embedding", bd.VocabParallelEmbedding, _randomised(nn.Embedding(VOCAB, IN, padding_idx=3), 2), {},
          lambda m: m(ids), lambda m: m(ids), SLICE)
    conv = Conv1D(OUT, IN)
    _trio("column conv1d", bd.ColumnParallelConv1D, conv, {"gather_output": True}, lambda m: m(x), lambda m: m(x),
          SLICE, twin_type=nn.Linear, transpose=("weight",))
    _trio("row conv1d", bd.RowParallelConv1D, conv, {"input_is_parallel": False}, lambda m: m(x), lambda m: m(x),
          SUMMED, twin_type=nn.Linear, transpose=("weight",))
    for activation in ("gelu", "swiglu"):
        mlp = _randomised(DenseMLP(IN, HIDDEN, activation), 3)
        _trio(f"mlp {activation}", bd.ParallelMLP, mlp, {}, lambda m: m(x), lambda m: m(x), SUMMED)
    lo, n = _range(HIDDEN, tp, ctx.tp_rank)
    for norm in (nn.BatchNorm1d(HIDDEN), nn.BatchNorm1d(HIDDEN, affine=False)):
        plain = _randomised(norm, 4).eval()  # eval: the running statistics are what it computes with
        _trio("batch norm", bd.ShardedBatchNorm1d, plain, {}, lambda m: m(rows[:, lo:lo + n]),
              lambda m: m(rows)[:, lo:lo + n], SLICE)
    for norm in (nn.LayerNorm(IN), nn.LayerNorm(IN, bias=False), nn.RMSNorm(IN, eps=1e-3)):
        cls = bd.LayerNorm if isinstance(norm, nn.LayerNorm) else bd.RMSNorm
        _trio(type(norm).__name__, cls, _randomised(norm, 5), {}, lambda m: m(x), lambda m: m(x), SLICE)
    for split, options in ((None, {}), ("column", {"gather_output": True}), ("row", {"input_is_parallel": False})):
        pair = _randomised(nn.Sequential(nn.Linear(IN, 3, bias=False), nn.Linear(3, OUT)), 6)
        _trio(f"low-rank pair, split {split}", LowRankPair, pair, {"split": split, **options}, lambda m: m(x),
              lambda m: m(x), SUMMED, twin_type=nn.Sequential)
    _dropout(tp, ctx)
    _heads_tp(tp, ctx, x)
    return True


def _range(total, tp, rank):
    lo, hi = bd.shard_range(total, tp, rank)
    return lo, hi - lo


def _dropout(tp, ctx):
    """No tensor to copy; the twin keeps p. In eval both are the identity (in training the twin draws
    its own masks: docs/layers.md)."""
    lo, n = _range(HIDDEN, tp, ctx.tp_rank)
    layer = bd.ShardedDropout.from_dense(nn.Dropout(0.25), global_size=HIDDEN, offset=lo).eval()
    h = _x(ROWS, n)
    assert torch.equal(layer(h), h)
    twin = layer.to_dense()
    assert type(twin) is nn.Dropout and twin.p == 0.25 and layer.load_dense_(twin) is layer


def _heads_tp(tp, ctx, x):
    """The head as a column layer of its logits, plain and with a margin and sampling (the twin
    drops them: they are loss options, not weights)."""
    plain = _randomised(nn.Linear(IN, OUT), 7)
    lo, n = _range(OUT, tp, ctx.tp_rank)
    target = torch.tensor([0, 6, 3, 2, 6, 1])
    _trio("head", bd.ParallelClassifierHead, plain, {"chunk_size": 4}, lambda m: m(x),
          lambda m: m(x).narrow(-1, lo, n), SLICE)
    head = bd.ParallelClassifierHead.from_dense(plain, chunk_size=4)
    assert_close(head.loss(x, target), F.cross_entropy(plain(x), target), "head loss", **SUMMED)
    no_bias = _randomised(nn.Linear(IN, OUT, bias=False), 8)
    cosine = F.normalize(x) @ F.normalize(no_bias.weight).t()
    _trio("margin head", bd.ParallelClassifierHead, no_bias, {"margin": "arcface", "sample_rate": 0.5, "scale": 8.0},
          lambda m: m(x), lambda m: 8.0 * cosine.narrow(-1, lo, n), SLICE)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_every_layer_keeps_the_trio_with_its_plain_twin(tp):
    assert all(run_ranks(_every_layer, tp, tp, timeout=DEADLINE))


def _world_head():
    ctx = bd.init_parallel(tp=2, dp=2)  # 11 classes over the 4 ranks of the mesh: 3, 3, 3, 2
    plain = _randomised(nn.Linear(IN, HIDDEN), 9)
    head = bd.ParallelClassifierHead.from_dense(plain, shard="world", chunk_size=4)
    assert head.shard == "world" and head.bd_shard_specs()["weight"].sizes == (3, 3, 3, 2)
    spec = head.shard_spec("weight")
    x = _x(ROWS, IN, seed=10 + ctx.dp_rank)  # each DP rank its own tokens
    target = torch.tensor([0, 10, 3, 2, 9, 1])
    assert_close(head(x), plain(x).narrow(-1, spec.start, spec.stop - spec.start), "world head logits", **SLICE)
    assert_close(head.loss(x, target), F.cross_entropy(plain(x), target), "world head loss", **SUMMED)
    twin = head.to_dense()  # a collective over all four ranks
    _twin_equals(twin, plain, "world head")
    other = _randomised(nn.Linear(IN, HIDDEN), 11)
    _twin_equals(head.load_dense_(other).to_dense(), other, "world head after load_dense_")
    no_bias = _randomised(nn.Linear(IN, HIDDEN, bias=False), 12)  # margins and sampling: loss options only
    face = bd.ParallelClassifierHead.from_dense(no_bias, shard="world", margin="cosface", sample_rate=0.5, scale=8.0)
    cosine = F.normalize(x) @ F.normalize(no_bias.weight).t()
    assert_close(face(x), 8.0 * cosine.narrow(-1, spec.start, spec.stop - spec.start), "world margin logits", **SLICE)
    assert torch.isfinite(face.loss(x, target))  # the sampled loss runs on the converted head
    _twin_equals(face.to_dense(), no_bias, "world margin head")
    return True


def test_the_world_sharded_head_keeps_the_trio():
    assert all(run_ranks(_world_head, 4, timeout=DEADLINE))


def test_bad_input_names_the_layer_and_what_was_expected():
    layer = bd.ColumnParallelLinear(IN, OUT)
    with pytest.raises(TypeError, match=r"ColumnParallelLinear.from_dense: expected an nn.Linear, got Embedding"):
        bd.ColumnParallelLinear.from_dense(nn.Embedding(3, 4))
    with pytest.raises(TypeError, match=r"ParallelMLP.load_dense_: expected an MLP module"):
        bd.ParallelMLP(IN, HIDDEN).load_dense_(nn.Linear(IN, HIDDEN))
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        layer.load_dense_(torch.zeros(OUT, IN))
    with pytest.raises(ValueError, match=r"weight: expected a full tensor of shape \(7, 5\), got \(5, 7\)"):
        layer.load_dense_(torch.zeros(IN, OUT), torch.zeros(OUT))
    with pytest.raises(ValueError, match=r"margin='arcface' .* got an nn.Linear with a bias"):
        bd.ParallelClassifierHead.from_dense(nn.Linear(IN, OUT), margin="arcface")
    with pytest.raises(TypeError, match=r"LowRankPair.from_dense: expected an nn.Sequential of two nn.Linear"):
        LowRankPair.from_dense(nn.Sequential(nn.Linear(IN, 3), nn.Linear(3, OUT)))  # a bias on the first
