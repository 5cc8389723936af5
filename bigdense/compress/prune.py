"""``--prune SPARSITY --structure ...``: `bd.prune` of the matching layers of the reference GPT.

* ``unstructured`` (one magnitude threshold over all the matching layers) and ``n:m`` (2:4): each
  layer keeps a ``weight_mask`` (recorded in the checkpoint's ``compressed.masks``; a load gives
  each such layer its mask, so a fine-tune from it keeps them). Parameters and FLOPs after count the nonzero weights (what
  a sparse product multiplies); once the checkpoint is written, `bd.to_sparse` turns each layer into
  a CSR product where that is faster on the job's batch, and the time after is that of what it chose.
* ``rows``: the hidden units of every block's MLP (`ParallelMLP`), the layers physically smaller;
  the new size is the checkpoint's ``model.d_hidden``, which a fine-tune from it
  (``trainer.init_from``) takes.

A layer's error is the part of its weight's Frobenius norm that was removed, ``sqrt(1 -
||W_after||^2 / ||W||^2)``, summed over the shards.
"""
from __future__ import annotations

import fnmatch
import math

import torch.nn as nn

from ..compression import prune, to_sparse
from ..layers import ParallelMLP
from .measure import counts, dense_layers, forward_ms, squared_norm


def _removed(before2: float, after2: float) -> float:
    return math.sqrt(max(0.0, 1.0 - after2 / before2)) if before2 > 0 else 0.0


def _snapshot(model: nn.Module, names: list[str], tokens: int) -> dict:
    """Per layer, what is measured before pruning: shape, bias, forward time, squared norm."""
    out = {}
    for name in names:
        layer = model.get_submodule(name)
        out[name] = {"type": type(layer).__name__, "in": layer.in_features, "out": layer.out_features,
                     "bias": layer.bias is not None, "forward_ms_before": forward_ms(layer, tokens),
                     "norm2": squared_norm(layer)}
    return out


def prune_masks(model: nn.Module, patterns, sparsity: float, structure: str, tokens: int) -> list[dict]:
    """``unstructured`` or ``n:m`` masks on the matching dense layers; per-layer rows (no time after yet)."""
    names = dense_layers(model, patterns)
    if not names:
        return []
    before = _snapshot(model, names, tokens)
    report = prune(model, sparsity, structure, layers=names)
    rows = []
    for name, b in before.items():
        kept, total = report.layers[name]
        rows.append({"layer": name, "type": b["type"], "in": b["in"], "out": b["out"], "structure": structure,
                     "density": kept / total, **counts(b["in"], b["out"], kept, b["bias"]),
                     "relative_frobenius_error": _removed(b["norm2"], squared_norm(model.get_submodule(name))),
                     "forward_ms_before": b["forward_ms_before"], "change": f"density {kept / total:.3f}"})
    return rows


def time_sparse(model: nn.Module, rows: list[dict], tokens: int) -> None:
    """After the masked checkpoint is written: `bd.to_sparse` on the pruned layers (a CSR product
    where it is faster on ``tokens`` rows), and each row's time after, of what it chose."""
    chosen = {r["layer"]: r for r in to_sparse(model, layers=[r["layer"] for r in rows], sample_tokens=tokens).layers}
    for row in rows:
        row["sparse_format"] = chosen[row["layer"]]["format"]
        row["forward_ms_after"] = forward_ms(model.get_submodule(row["layer"]), tokens)
        row["change"] += f", {row['sparse_format'] or 'dense'}"


def prune_rows(model: nn.Module, patterns, sparsity: float, tokens: int) -> list[dict]:
    """``sparsity`` of the hidden units of every block's MLP; per-layer rows. The MLPs must all match
    (the GPT has one ``model.d_hidden``)."""
    mlps = [n for n, m in model.named_modules() if isinstance(m, ParallelMLP)]
    chosen = [n for n in mlps if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not chosen:
        return []
    if chosen != mlps:
        raise ValueError(f"--prune --structure rows shrinks every block's MLP alike (the GPT has one model.d_hidden); "
                         f"--layers matches {chosen}, not all of {mlps}")
    names = [f"{m}.{p}" for m in chosen for p in ("gate", "up", "down")
             if getattr(model.get_submodule(m), p, None) is not None]
    before = _snapshot(model, names, tokens)
    prune(model, sparsity, "rows", layers=chosen)
    rows = []
    for name, b in before.items():
        layer = model.get_submodule(name)
        in_a, out_a = layer.in_features, layer.out_features
        row = {"layer": name, "type": b["type"], "in": b["in"], "out": b["out"], "structure": "rows",
               **counts(b["in"], b["out"], in_a * out_a, b["bias"]),
               "relative_frobenius_error": _removed(b["norm2"], squared_norm(layer)),
               "forward_ms_before": b["forward_ms_before"], "forward_ms_after": forward_ms(layer, tokens),
               "change": f"{b['out']}x{b['in']} -> {out_a}x{in_a}"}
        row["params_after"] = in_a * out_a + b["bias"] * out_a  # the bias of a shrunk up/gate shrinks with it
        rows.append(row)
    return rows


def record(cfg, model: nn.Module, rows: list[dict], sparsity: float, structure: str) -> dict:
    """The structure in the written checkpoint's config: ``model.d_hidden`` (rows) or the masked layers
    (``compressed.masks``); returns the report's entries."""
    from omegaconf import OmegaConf

    names = [r["layer"] for r in rows]
    if structure == "rows":
        d_hidden = next(m.d_hidden for _, m in model.named_modules() if isinstance(m, ParallelMLP))
        OmegaConf.update(cfg, "model.d_hidden", d_hidden, merge=False)
        OmegaConf.update(cfg, "compressed.rows", {"sparsity": sparsity, "d_hidden": d_hidden}, merge=False)
        return {"d_hidden": d_hidden}
    masks = sorted(set(cfg.get("compressed", {}).get("masks") or []) | set(names))
    OmegaConf.update(cfg, "compressed.masks", masks, merge=False)
    return {"masked_layers": masks}
