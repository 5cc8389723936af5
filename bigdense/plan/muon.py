"""Muon (``optim.name=muon``, `bigdense.muon`) in the memory planner: state, traffic and FLOPs.

`Muon` steps the 2-D weights of the dense layers (`muon_names`) and AdamW the rest. Per rank it keeps
one fp32 momentum buffer shaped like each Muon weight's local tensor, and AdamW's two fp32 moments
of every other trainable parameter. Each step it sends every whole logical matrix to one owner rank,
which orthogonalises it (Newton-Schulz), and sends each rank its piece of the result back.

The planner builds the optimizer's own matrix geometries (`geometry.matrices_of`) from its
parameter entries -- the TP split as a `ShardSpec` of the planned size, the logical blocks the meta
model's layers declare (q, k, v of a fused qkv; a packed ``[gate; up]``'s), the FSDP chunking of
``dp_shard`` ranks -- and hands them to the optimizer's own `Exchange` with no process group (it
then only sizes the collectives), so the bytes each rank sends, the collectives and the owner of
each matrix are the ones a real step has. Per rank (world rank ``dp * tp + tp_rank``):

* ``state_bytes``: the momentum buffers and AdamW's moments, on the local tensors (FSDP: a rank's
  ``torch.chunk`` chunk of dim 0, unpadded, as ``zeros_like`` of a sharded DTensor makes it);
* ``sent_bytes``: what the rank sends to other ranks per step, in the Newton-Schulz dtype (both
  schemes move the same bytes; ``collectives`` differs: two per round, or two per matrix);
* ``ns_flops``: the Newton-Schulz FLOPs of the matrices it owns (`Assignment.work`);
* ``step_bytes``: the step's transient peak above the state (`bigdense.plan.muon_step`).

A plan depends on the mesh, the engine, the device type and the settings only, and is kept per
model for the layouts `suggest` tries.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..muon.exchange import SCHEMES, Exchange
from ..muon.geometry import Layout as Mesh
from ..muon.geometry import matrices_of
from ..muon.groups import muon_names
from ..muon.newton_schulz import ns_dtype as resolve_ns_dtype
from ..muon.newton_schulz import ns_flops
from ..parallel.sharding import ShardSpec, logical_blocks_of
from .layout import Layout
from .muon_step import FP32, MuonStep, local_shape


@dataclass(frozen=True)
class MuonSettings:
    """The ``optim`` keys that shape Muon's memory and traffic."""

    scheme: str = "all_to_all"  # optim.muon_comm
    split_blocks: bool = True  # optim.muon_blocks == "split"
    ns_steps: int = 5
    ns_dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 elsewhere), "fp32" or "bf16"
    nesterov: bool = True

    @classmethod
    def of(cls, optim_cfg) -> Optional["MuonSettings"]:
        """The settings of a training config's ``optim`` group; None unless ``optim.name=muon``."""
        if str(optim_cfg.name) != "muon":
            return None
        return cls(str(optim_cfg.muon_comm), str(optim_cfg.muon_blocks) == "split", int(optim_cfg.ns_steps),
                   str(optim_cfg.ns_dtype), bool(optim_cfg.nesterov))

    def dtype(self, device_type: str) -> torch.dtype:
        """The Newton-Schulz (and exchange) dtype on ``device_type``, as the optimizer resolves it."""
        return resolve_ns_dtype(self.ns_dtype, device_type)


@dataclass
class MuonPlan:
    """Muon's figures for one layout, per world rank (lists indexed by rank)."""

    scheme: str
    ns_dtype: str  # "fp32" or "bf16"
    matrices: int  # the logical matrices orthogonalised per step
    rounds: int  # rounds of at most one matrix per rank
    collectives: dict  # scheme -> all-to-alls per step on every rank
    sent_bytes: list = field(default_factory=list)
    ns_flops: list = field(default_factory=list)
    state_bytes: list = field(default_factory=list)
    step_bytes: list = field(default_factory=list)
    owners: list = field(default_factory=list)  # owners[m]: the rank that orthogonalises matrix m

    def busiest(self, key: str) -> int:
        return max(getattr(self, key), default=0)


def mesh_of(layout: Layout):
    """The optimizer's `geometry.Layout` of a planner `Layout` (FSDP's shard count included)."""
    return Mesh(layout.tp, layout.dp, layout.dp_shard)


def planned_spec(entry, tp: int) -> Optional[ShardSpec]:
    """The `ShardSpec` the entry's layer marks at TP size ``tp`` (rank 0's; the geometry reads every
    rank's boxes from it), or None for a parameter replicated over TP."""
    if entry.split_dim is None:
        return None
    return ShardSpec.balanced(entry.global_shape, entry.split_dim, tp, 0, entry.packed)


def muon_weights(model: nn.Module, entries, layout: Layout, split_blocks: bool) -> list[tuple]:
    """``[(entry, [MatrixGeometry, ...])]`` of the weights Muon steps, in the optimizer's order
    (`muon_names`), each with the matrices `build_muon` makes of it at ``layout``."""
    params, by_name, mesh = dict(model.named_parameters()), {e.name: e for e in entries}, mesh_of(layout)
    out = []
    for name in muon_names(model):
        entry, spec = by_name[name], planned_spec(by_name[name], layout.tp)
        # The parameter as the planned layout marks it: the blocks its layer declares, else its spec's packed ones.
        marked = SimpleNamespace(bd_logical_blocks=getattr(params[name], "bd_logical_blocks", None), bd_shard_spec=spec)
        blocks = logical_blocks_of(marked)
        if blocks is not None and any(r.is_meta for r in blocks.rows):
            raise ValueError(f"{name}: its logical blocks are on the meta device, without values, which Muon's "
                             f"geometry reads: declare them with mark_logical_blocks (it keeps them on the CPU)")
        out.append((entry, matrices_of(name, entry.global_shape, spec, blocks, mesh,
                                       split_blocks=split_blocks, fsdp=layout.dp_shard > 1)))
    return out


def state_bytes(entries, muon: set, layout: Layout, rank: int) -> int:
    """Optimizer state on ``rank``: a momentum buffer per Muon weight, AdamW's two moments per other
    trainable parameter (fp32; AdamW's step counters, a scalar each, left out as for AdamW)."""
    return sum(math.prod(local_shape(e, layout, rank)) * FP32 * (1 if e.name in muon else 2)
               for e in entries if e.trainable)


# Plans already made for a model: `suggest` estimates many layouts that differ only in what Muon
# does not read (micro-batch, recompute, precision, sequence parallelism).
_PLANS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def plan_muon(model: nn.Module, entries, layout: Layout, settings: MuonSettings) -> MuonPlan:
    """Muon's state, traffic, FLOPs and step transient per rank of ``model`` (its parameters:
    ``entries``, `param_entries` at ``layout.tp``) trained at ``layout``."""
    key = (tuple(entries), layout.tp, layout.dp, layout.dp_shard, layout.engine, layout.device_type, settings)
    plans = _PLANS.setdefault(model, {})
    if key not in plans:
        plans[key] = _plan(model, entries, layout, settings)
    return plans[key]


def _plan(model: nn.Module, entries, layout: Layout, settings: MuonSettings) -> MuonPlan:

    if layout.engine not in ("ddp", "fsdp"):
        raise ConfigError(f"optim.name=muon runs on engine=ddp or engine=fsdp, not engine={layout.engine}")
    weights = muon_weights(model, entries, layout, settings.split_blocks)
    if not weights:
        raise ConfigError(f"optim.name=muon: {type(model).__name__} has no trainable dense-layer weight for Muon; "
                          f"use optim.name=adamw")
    flat = [m for _, ms in weights for m in ms]
    flops = [ns_flops(m.shape, settings.ns_steps) for m in flat]
    exchanges = {s: Exchange(flat, flops, mesh_of(layout), 0, None, s) for s in SCHEMES}
    exchange, dtype = exchanges[settings.scheme], settings.dtype(layout.device_type)
    width = torch.empty((), dtype=dtype).element_size()
    world, names = layout.tp * layout.dp, {e.name for e, _ in weights}
    step = MuonStep(weights, exchange, layout, width, settings.nesterov)
    return MuonPlan(
        settings.scheme, "bf16" if dtype == torch.bfloat16 else "fp32", len(flat), len(exchange.assignment.rounds),
        {s: ex.collectives() for s, ex in exchanges.items()},
        sent_bytes=[exchange.bytes_sent(r, width) for r in range(world)],
        ns_flops=list(exchange.assignment.work),
        state_bytes=[state_bytes(entries, names, layout, r) for r in range(world)],
        step_bytes=[step.peak(r) for r in range(world)],
        owners=list(exchange.assignment.owners))


def muon_time(plan: MuonPlan, tflops: float, gbps: float, latency_us: float) -> float:
    """A modelled time of Muon's step beyond AdamW's (seconds): the busiest rank's Newton-Schulz
    FLOPs at ``tflops``, the most any rank sends at ``gbps`` (GB/s, the exchange crossing the whole
    mesh: its slowest link), and ``latency_us`` per collective. Momentum and the update are
    elementwise and left out; nothing overlaps."""
    return (plan.busiest("ns_flops") / (tflops * 1e12) + plan.busiest("sent_bytes") / (gbps * 1e9)
            + plan.collectives[plan.scheme] * latency_us * 1e-6)
