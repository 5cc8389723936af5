"""Low-rank compression of dense layers: ``W (out, in) ~= U_r S_r V_r^T`` as two thinner layers.

    pair = bd.low_rank(layer, energy=0.9)      # a LowRankPair, an nn.Sequential(first, second): in -> r -> out

``first`` computes ``x V_r S_r^(1/2)`` and ``second`` multiplies by ``S_r^(1/2) U_r^T`` and adds the
original bias; the product of their weights is the best rank-r approximation of ``W``
(Eckart-Young), up to the randomised SVD's stated error (`bigdense.layers.svd`). Sharding keeps the
original layer's interface and never adds communication:

===========================  ==========================================  ===========================
original                     first (in -> r)      second (r -> out)       collectives (fwd / bwd)
===========================  ==========================================  ===========================
``nn.Linear``                ``nn.Linear``        ``nn.Linear``           none
``ColumnParallelLinear``     ``nn.Linear``,       ``ColumnParallelLinear``  - / all-reduce of r
                             replicated           (rows of U as W's rows)   features, not ``in``
``RowParallelLinear``        ``RowParallelLinear`` ``nn.Linear``,          all-reduce of r, not
                             (V's rows as W's     replicated, bias          ``out`` / -
                             columns)
===========================  ==========================================  ===========================

The pair's plain twin is ``nn.Sequential(nn.Linear(in, r, bias=False), nn.Linear(r, out))`` with
the full factors (`LowRankPair`: ``from_dense``, ``to_dense``, ``load_dense_`` as every layer's).

The SVD runs on the shards where they are (the column layer's rows of ``W``, the row layer's rows
of ``W^T``): no rank holds the whole matrix. ``energy=e`` keeps the smallest r whose squared
singular values reach ``e`` of ``||W||_F^2``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..layers.base import DenseTwin, materialize
from ..layers.head import ParallelClassifierHead
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .svd import ShardedSVD, sharded_svd


SPLITS = (None, "column", "row")  # which half of a pair is sharded: none, the second (column), the first (row)


class LowRankPair(DenseTwin, nn.Sequential):
    """``nn.Sequential(first, second)``, ``in -> rank -> out``, the bias on ``second``: what `low_rank`
    returns (``rank``; ``singular_values``, the SVD's, when `low_rank` made it).

    Its plain twin (`DenseTwin`) is ``nn.Sequential(nn.Linear(in, rank, bias=False), nn.Linear(rank,
    out))`` with the full factors: ``to_dense`` gathers the sharded half (a collective);
    ``load_dense_(first_weight, second_weight, bias)`` copies this rank's slices; and
    ``LowRankPair.from_dense(twin, split=None | "column" | "row", **options)`` shards it as `low_rank`
    shards the pair of a column layer (``second``) or a row layer (``first``), ``options`` going to
    that half (``tp_group``, ``gather_output`` or ``input_is_parallel``).
    """

    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__(first, second)
        self.rank, self.singular_values = first.out_features, None

    def _dense_twin(self) -> nn.Sequential:
        first, second = self
        return nn.Sequential(nn.Linear(first.in_features, self.rank, bias=False, device="meta"),
                             nn.Linear(self.rank, second.out_features, bias=second.bias is not None, device="meta"))

    @classmethod
    def _check_dense(cls, pair, method: str) -> None:
        halves = list(pair) if isinstance(pair, nn.Sequential) else []
        shaped = (len(halves) == 2 and all(type(h) is nn.Linear for h in halves) and halves[0].bias is None
                  and halves[0].out_features == halves[1].in_features)
        if not shaped:
            got = [type(h).__name__ for h in halves] if halves else type(pair).__name__
            raise TypeError(f"{cls.__name__}.{method}: expected an nn.Sequential of two nn.Linear, in -> r (no bias) "
                            f"-> out, got {got}")

    @classmethod
    def _empty_from_dense(cls, pair: nn.Sequential, *, split: Optional[str] = None, **options) -> "LowRankPair":
        first, second = pair
        halves = _halves(split, first.in_features, second.out_features, first.out_features,
                         second.bias is not None, first.weight.dtype, **options)
        return cls(*halves).to_empty(device=first.weight.device)


def _halves(split: Optional[str], in_features: int, out_features: int, rank: int, bias: bool, dtype,
            **options) -> tuple[nn.Module, nn.Module]:
    """(first, second) of a pair with ``split`` (`SPLITS`), on the meta device; ``options`` for the sharded half."""
    if split not in SPLITS:
        raise ValueError(f"LowRankPair: split must be one of {SPLITS}, got {split!r}")
    if split is None and options:
        raise TypeError(f"LowRankPair: options {sorted(options)} are for a sharded half; split=None has none")
    kw = dict(device="meta", dtype=dtype)
    if split == "column":
        return (nn.Linear(in_features, rank, bias=False, **kw),
                ColumnParallelLinear(rank, out_features, bias=bias, **options, **kw))
    if split == "row":
        return (RowParallelLinear(in_features, rank, bias=False, **options, **kw),
                nn.Linear(rank, out_features, bias=bias, **kw))
    return nn.Linear(in_features, rank, bias=False, **kw), nn.Linear(rank, out_features, bias=bias, **kw)


def _describe(layer: nn.Module) -> str:
    return f"{type(layer).__name__}(in_features={layer.in_features}, out_features={layer.out_features})"


def _check_request(layer: nn.Module, rank, energy) -> None:
    if not isinstance(layer, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) or isinstance(
            layer, ParallelClassifierHead):
        raise TypeError(f"low_rank: expected an nn.Linear, ColumnParallelLinear or RowParallelLinear, "
                        f"got {type(layer).__name__}")
    if getattr(layer, "sequence_parallel", False):
        # The replicated half of a pair would see only this rank's share of the sequence.
        raise ValueError(f"low_rank({_describe(layer)}): sequence_parallel=True layers cannot be compressed; "
                         f"build the model with sequence_parallel=False (checkpoints are the same)")
    if (rank is None) == (energy is None):
        raise ValueError(f"low_rank({_describe(layer)}): give exactly one of rank= and energy=, "
                         f"got rank={rank!r}, energy={energy!r}")
    full = min(layer.in_features, layer.out_features)
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= full):
        raise ValueError(f"low_rank({_describe(layer)}): rank must be an integer in [1, {full}] "
                         f"(min(in_features, out_features)), got {rank!r}")
    if energy is not None:
        check_energy(energy, f"low_rank({_describe(layer)})")


def check_energy(energy, where: str) -> None:
    if isinstance(energy, bool) or not (isinstance(energy, (int, float)) and 0 < energy <= 1):
        raise ValueError(f"{where}: energy must be in (0, 1], got {energy!r}")


def _svd(layer: nn.Module, rank, energy, oversample: int, power_iters: int, seed: int) -> tuple[ShardedSVD, int]:
    """The SVD of the weight, sharded by rows (W for a column layer, W^T otherwise), and the rank."""
    group = getattr(layer, "tp_group", None)
    rows = layer.weight.detach() if not isinstance(layer, RowParallelLinear) else layer.weight.detach().t()
    full = min(layer.in_features, layer.out_features)
    guess = rank if rank is not None else min(full, 64)
    while True:
        svd = sharded_svd(rows, guess, group, oversample=oversample, power_iters=power_iters, seed=seed)
        if rank is not None:
            return svd, rank
        chosen = svd.rank_for_energy(float(energy))
        if chosen is not None and (chosen <= guess or len(svd.S) >= full):
            return svd, min(chosen, full)
        if len(svd.S) >= full:  # every singular value is in: rounding kept the sum short of e
            return svd, full
        guess = min(full, 2 * guess)


@torch.no_grad()
def low_rank(
    layer: nn.Module,
    rank: Optional[int] = None,
    energy: Optional[float] = None,
    *,
    oversample: int = 10,
    power_iters: int = 2,
    seed: int = 0,
) -> LowRankPair:
    """A `LowRankPair`, ``nn.Sequential(first, second)``, whose product is the best rank-r approximation of ``layer``.

    Give ``rank`` (1 .. min(in, out)) or ``energy`` in (0, 1]. ``layer``: ``nn.Linear``,
    `ColumnParallelLinear` (keeps ``gather_output``) or `RowParallelLinear` (keeps
    ``input_is_parallel``); the pair runs on the same TP group, same device and dtype, bias on
    ``second``. Collective for a parallel layer (every TP rank calls it; ``seed`` must agree).
    ``oversample``/``power_iters``/``seed``: the randomised SVD's (`bigdense.layers.svd.sharded_svd`).
    The chosen rank is ``pair.rank``; ``pair.singular_values`` are the SVD's (all it computed).
    """
    _check_request(layer, rank, energy)
    svd, r = _svd(layer, rank, energy, oversample, power_iters, seed)
    root = svd.S[:r].sqrt()
    left = svd.U_local[:, :r] * root  # rows of W (or of W^T) times S^(1/2)
    right = svd.V[:, :r] * root
    pair = _pair(layer, r).to_empty(device=layer.weight.device)
    first, second = pair
    if isinstance(layer, RowParallelLinear):
        first.weight.copy_(left.t())
        second.weight.copy_(right)
    else:
        first.weight.copy_(right.t())
        second.weight.copy_(left)
    if layer.bias is not None:
        second.bias.copy_(layer.bias)
    pair.rank, pair.singular_values = r, svd.S.detach().cpu()
    return pair


def _pair(layer: nn.Module, rank: int) -> LowRankPair:
    """The pair of ``layer``'s shapes and sharding at ``rank``, on the meta device, ``layer``'s dtype."""
    if isinstance(layer, ColumnParallelLinear):
        split, options = "column", dict(tp_group=layer.tp_group, gather_output=layer.gather_output)
    elif isinstance(layer, RowParallelLinear):
        split, options = "row", dict(tp_group=layer.tp_group, input_is_parallel=layer.input_is_parallel)
    else:
        split, options = None, {}
    return LowRankPair(*_halves(split, layer.in_features, layer.out_features, rank, layer.bias is not None,
                                layer.weight.dtype, **options))


def low_rank_like(layer: nn.Module, rank: int) -> LowRankPair:
    """The pair `low_rank` would return at this ``rank``, freshly initialised (no SVD): the structure
    a compressed checkpoint loads into. Not a collective."""
    _check_request(layer, rank, None)
    return materialize(_pair(layer, rank), layer.weight.device)
