"""``--energy`` / ``--rank``: the matching dense layers replaced by low-rank pairs (`bd.low_rank`)."""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from ..layers import ColumnParallelLinear, RowParallelLinear
from ..layers.base import replace_module
from ..compression.lowrank import low_rank
from ..parallel import comm
from .measure import counts, dense_layers, forward_ms


@torch.no_grad()
def relative_error(layer: nn.Module, pair: nn.Sequential) -> float:
    """``||W - second.W @ first.W||_F / ||W||_F``, summed over this rank's rows or columns of W."""
    first, second = pair
    approx = second.weight @ first.weight  # this rank's rows (column) or columns (row) of W_r
    w = layer.weight.detach().float()
    sums = torch.stack([(w - approx.float()).pow(2).sum(), w.pow(2).sum()]).double()
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        comm.all_reduce_(sums, layer.tp_group)
    return float((sums[0] / sums[1]).sqrt())


def compress_model(model: nn.Module, patterns, *, energy=None, rank=None, tokens: int = 1024,
                   seed: int = 0) -> list[dict]:
    """Replace the matching dense layers of ``model`` in place by low-rank pairs; per-layer rows.

    A layer whose pair would not have fewer parameters stays dense (its row says ``"kept": true``).
    Collective when the model is sharded.
    """
    rows = []
    for name in dense_layers(model, patterns):
        layer = model.get_submodule(name)
        before_ms = forward_ms(layer, tokens)
        t = time.perf_counter()
        pair = low_rank(layer, rank=rank, energy=energy, seed=seed)
        svd_s = time.perf_counter() - t
        in_f, out_f = layer.in_features, layer.out_features
        kept = pair.rank * (in_f + out_f) >= in_f * out_f
        row = {"layer": name, "type": type(layer).__name__, "in": in_f, "out": out_f, "rank": pair.rank,
               "kept": kept, **counts(in_f, out_f, in_f * out_f if kept else pair.rank * (in_f + out_f),
                                      layer.bias is not None),
               "relative_frobenius_error": 0.0 if kept else relative_error(layer, pair), "svd_s": svd_s,
               "forward_ms_before": before_ms, "change": "kept dense" if kept else f"rank {pair.rank}"}
        if not kept:
            replace_module(model, name, pair)
        row["forward_ms_after"] = forward_ms(pair, tokens) if not kept else before_ms
        rows.append(row)
    return rows


def record(cfg, rows: list[dict]) -> dict:
    """The structure in the written checkpoint's config: ``model.low_rank`` (every compressed layer's rank)."""
    from omegaconf import OmegaConf

    low = dict(cfg.model.get("low_rank") or {})
    low.update({r["layer"]: r["rank"] for r in rows if not r["kept"]})
    OmegaConf.update(cfg, "model.low_rank", low, merge=False)
    return {"low_rank": low}
