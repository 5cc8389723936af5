"""Muon for sharded dense layers: whole-matrix Newton-Schulz at any TP x DP layout (docs/training.md).

``optim.name=muon`` makes the engines build `Muon` with `build_muon`: the dense weights
(`groups.muon_names`) as matrices laid out by `geometry`, assigned to ranks by `assignment`, moved
by `exchange`, orthogonalised by `newton_schulz`; AdamW for the rest. `check_muon_options` owns
the ``optim`` keys Muon adds.
"""
from __future__ import annotations

import torch.nn as nn

from ..errors import ConfigError, check_choice, check_positive, check_positive_int
from ..parallel.sharding import is_dtensor, logical_blocks_of, shard_spec_of
from .exchange import SCHEMES, Exchange
from .geometry import Layout, MatrixGeometry, matrices_of
from .groups import muon_names, muon_param_groups
from .newton_schulz import (
    ADJUST_LR, NS_COMPILE, lr_ratio, ns_backend, ns_dtype, ns_flops, orthogonalize,
)
from .optimizer import Muon

BLOCKS = ("split", "whole")  # optim.muon_blocks: each stacked matrix alone (q, k, v; gate, up), or the weight whole
NS_DTYPES = ("auto", "fp32", "bf16")  # optim.ns_dtype


def check_muon_options(optim_cfg) -> None:
    """The rules of the ``optim`` keys Muon reads (checked whatever ``optim.name`` is)."""
    momentum = float(optim_cfg.momentum)
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"optim.momentum must be in [0, 1), got {momentum}")
    steps = optim_cfg.ns_steps
    check_positive_int("optim.ns_steps", steps, ConfigError)
    if int(steps) >= 100:
        raise ConfigError(f"optim.ns_steps must be below 100 (as torch.optim.Muon's), got {steps}")
    coefficients = list(optim_cfg.ns_coefficients)
    if len(coefficients) != 3:
        raise ConfigError(f"optim.ns_coefficients must be three numbers (a, b, c), got {coefficients}")
    check_positive("optim.ns_eps", optim_cfg.ns_eps)
    check_choice("optim.adjust_lr", str(optim_cfg.adjust_lr), ADJUST_LR)
    check_choice("optim.muon_comm", str(optim_cfg.muon_comm), SCHEMES)
    check_choice("optim.muon_blocks", str(optim_cfg.muon_blocks), BLOCKS)
    check_choice("optim.ns_dtype", str(optim_cfg.ns_dtype), NS_DTYPES)
    check_choice("optim.ns_compile", str(optim_cfg.ns_compile), NS_COMPILE)


def model_matrices(model: nn.Module, layout: Layout, *, split_blocks: bool = True,
                   fsdp: bool = False) -> list[list[MatrixGeometry]]:
    """The matrices of each parameter Muon steps (`muon_names` order)."""
    params = dict(model.named_parameters())
    out = []
    for name in muon_names(model):
        p = params[name]
        spec = shard_spec_of(p)
        shape = spec.global_shape if spec is not None else tuple(p.shape)
        out.append(matrices_of(name, shape, spec, logical_blocks_of(p), layout, split_blocks=split_blocks,
                               fsdp=fsdp and is_dtensor(p)))
    return out


def build_muon(model: nn.Module, ctx, optim_cfg, *, groups=None, dp_shard: int = 1, group=None, fused=None,
               capturable: bool = False) -> Muon:
    """`Muon` over ``model`` (already under DDP or FSDP) on ``ctx``'s mesh, with ``optim``'s settings;
    ``groups``: `muon_param_groups` (the default) or a subset of them; ``group``: the process group
    spanning the mesh; ``dp_shard``: the DP ranks FSDP shards each weight over (1: DDP)."""
    check_muon_options(optim_cfg)
    layout = Layout(ctx.tp_size, ctx.dp_size, dp_shard)
    groups = muon_param_groups(model, float(optim_cfg.weight_decay)) if groups is None else groups
    if not any(g["muon"] for g in groups):
        raise ConfigError(f"optim.name=muon: {type(model).__name__} has no trainable dense-layer weight for Muon "
                          f"(a LoRA run trains adapter factors only); use optim.name=adamw")
    matrices = model_matrices(model, layout, split_blocks=str(optim_cfg.muon_blocks) == "split",
                              fsdp=dp_shard > 1)
    return Muon(groups, matrices, layout=layout, rank=ctx.rank if ctx.is_distributed else 0, group=group,
                lr=float(optim_cfg.lr), weight_decay=float(optim_cfg.weight_decay),
                momentum=float(optim_cfg.momentum), nesterov=bool(optim_cfg.nesterov),
                ns_coefficients=tuple(float(c) for c in optim_cfg.ns_coefficients),
                ns_steps=int(optim_cfg.ns_steps), eps=float(optim_cfg.ns_eps),
                adjust_lr=str(optim_cfg.adjust_lr),
                betas=tuple(float(b) for b in optim_cfg.betas), adam_eps=float(optim_cfg.eps),
                comm=str(optim_cfg.muon_comm),
                ns_dtype=ns_dtype(str(optim_cfg.ns_dtype), ctx.device.type),
                ns_backend=ns_backend(str(optim_cfg.ns_compile), ctx.device.type),
                fused=fused, capturable=capturable)


__all__ = ["Muon", "build_muon", "check_muon_options", "muon_param_groups", "muon_names", "model_matrices",
           "Layout", "MatrixGeometry", "Exchange", "orthogonalize", "lr_ratio", "ns_flops", "SCHEMES"]
