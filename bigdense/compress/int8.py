"""``--int8``: the matching dense layers' weights in int8, one scale per output feature (`bd.Int8Linear`).

For inference: the written checkpoint holds each layer's int8 ``weight`` and ``weight_scale``
(recorded in its config's ``compressed.int8``, so it loads into the GPT given those layers).
Parameters and FLOPs do not change; the weights' bytes do. A layer's error is ``||W - q s||_F /
||W||_F``, summed over the shards.
"""
from __future__ import annotations

import math

import torch.nn as nn

from ..compression import Int8Linear
from ..compression.inference import masked_weight
from ..layers.base import replace_module
from .measure import counts, dense_layers, forward_ms, summed_over_shards


def quantize_layers(model: nn.Module, patterns, tokens: int) -> list[dict]:
    """Replace the matching dense layers of ``model`` in place by `Int8Linear`; per-layer rows."""
    rows = []
    for name in dense_layers(model, patterns):
        layer = model.get_submodule(name)
        before_ms = forward_ms(layer, tokens)
        quantized = Int8Linear(layer)
        weight = masked_weight(layer).float()
        err2, norm2 = summed_over_shards(layer, [(weight - quantized.dequantized_weight().float()).pow(2).sum(),
                                                 weight.pow(2).sum()])
        replace_module(model, name, quantized)
        in_f, out_f, bias = layer.in_features, layer.out_features, layer.bias is not None
        width = layer.weight.element_size()
        rows.append({"layer": name, "type": type(layer).__name__, "in": in_f, "out": out_f,
                     **counts(in_f, out_f, in_f * out_f, bias),
                     "weight_bytes_before": in_f * out_f * width,
                     "weight_bytes_after": in_f * out_f + out_f * quantized.weight_scale.element_size(),
                     "relative_frobenius_error": math.sqrt(err2 / norm2) if norm2 > 0 else 0.0,
                     "forward_ms_before": before_ms, "forward_ms_after": forward_ms(quantized, tokens),
                     "change": "int8"})
    return rows


def record(cfg, rows: list[dict]) -> dict:
    """The int8 layers in the written checkpoint's config (``compressed.int8``)."""
    from omegaconf import OmegaConf

    names = sorted(set(cfg.get("compressed", {}).get("int8") or []) | {r["layer"] for r in rows})
    OmegaConf.update(cfg, "compressed.int8", names, merge=False)
    return {"int8_layers": names}
