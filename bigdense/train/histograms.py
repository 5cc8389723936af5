"""Histograms of every dense layer's weight and weight gradient, each over the whole (unsharded)
tensor, from all-reduced bin counts: no rank gathers a tensor it does not hold.

Per tensor, the ranks first agree on its global minimum and maximum (one MIN all-reduce of every
tensor's ``(min, -max)`` over the TP group, and over the FSDP mesh for DTensors). Every rank then
computes the same ``bins + 1`` edges from those two numbers (`bin_edges`), bins its own elements
against them with `torch.bucketize`, and one SUM all-reduce adds every tensor's counts, sum and sum
of squares. An element's bin depends only on its value and the edges, never on which rank holds it,
so the counts, minimum and maximum are exactly the same at every TP (and FSDP) size; the sum and
sum of squares differ by float64 rounding of the regrouped sums only.

As in `DenseLayerStats.collect`, a tensor replicated over TP is counted on TP rank 0 only (and a
DTensor's replicas, or a plain tensor replicated over the FSDP mesh, at coordinate 0 only), so
each element is counted once. At most six small all-reduces per call (two per group: TP and each
FSDP mesh dimension), whatever the number of layers; the host reads the results at the end only,
so the loop calls it on its logging steps only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..parallel import comm
from ..parallel.sharding import is_dtensor, is_world_sharded, local_tensor, shard_spec_of
from .metrics import weighted_dense_layers

BINS = 64  # TensorBoard's own histograms use 30; 64 resolves a weight's bulk and its tails
_CHUNK = 1 << 22  # elements binned at a time: bounds the int32 bin indices and float64 copies


@dataclass
class Histogram:
    """One tensor's histogram in the form of TensorBoard's ``add_histogram_raw``: ``bucket_limits``
    are right edges, the first one the left edge of an empty bucket (TensorBoard's own convention,
    so the lowest edge shows), so ``bucket_counts[0]`` is 0 and ``bucket_counts[i]`` (i >= 1) is the
    number of elements in ``[bucket_limits[i-1], bucket_limits[i])``, the last bucket closed."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]


def bin_edges(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """``[..., bins + 1]`` float32 edges spaced evenly over ``[lo, hi]`` (float32 tensors of any
    shape), the first exactly ``lo`` and the last exactly ``hi``; a constant tensor (``lo == hi``)
    gets ``[lo - 0.5, hi + 0.5]``, as ``numpy.histogram`` does. Computed in float64 and rounded,
    the same arithmetic on every rank from the same all-reduced ``lo``/``hi``."""
    flat = lo == hi
    lo = torch.where(flat, lo - 0.5, lo).double().unsqueeze(-1)
    hi = torch.where(flat, hi + 0.5, hi).double().unsqueeze(-1)
    frac = torch.arange(bins + 1, dtype=torch.float64, device=lo.device) / bins
    edges = (lo + (hi - lo) * frac).float()
    edges[..., 0], edges[..., -1] = lo[..., 0].float(), hi[..., 0].float()
    return edges


def bin_counts(t: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``[bins + 2]`` float64: how many elements of ``t`` fall in each bin of ``edges`` (``[x_i,
    x_{i+1})``, the last bin closed; values outside the edges land in the end bins), then the
    elements' sum and sum of squares. In chunks, so no full float32 or index copy is made."""
    bins = edges.numel() - 1
    out = torch.zeros(bins + 2, dtype=torch.float64, device=t.device)
    inner = edges[1:-1].contiguous()
    for chunk in t.reshape(-1).split(_CHUNK):
        chunk = chunk.float()
        out[:bins] += torch.bincount(torch.bucketize(chunk, inner, right=True, out_int32=True), minlength=bins)
        wide = chunk.double()
        out[bins] += wide.sum()
        out[bins + 1] += wide.square().sum()
    return out


@dataclass
class _Entry:
    tag: str
    local: Optional[torch.Tensor]  # this rank's elements, None where the tensor is absent (no grad)
    own: bool  # whether this rank counts them (one holder of each element does)


class DenseLayerHistograms:
    """``hist/<layer>/weight`` and ``hist/<layer>/grad`` histograms of every dense layer (the
    layers `DenseLayerStats` reports), each over the whole tensor at every TP size; a collective
    over TP (and the FSDP mesh), so every rank calls `collect` (only the main rank writes them,
    `MetricsLog.write_histograms`)."""

    def __init__(self, model: nn.Module, tp_group, bins: int = BINS):
        if not isinstance(bins, int) or bins < 1:
            raise ValueError(f"DenseLayerHistograms: bins must be a positive int, got {bins!r}")
        self.tp_group, self.bins = tp_group, bins
        self._layers = weighted_dense_layers(model)
        for name, module in self._layers.items():
            if is_world_sharded(module.weight):
                raise ValueError(f"DenseLayerHistograms: {name}'s weight is split over every rank (a world-sharded "
                                 "head); histograms sum over the TP group and the FSDP mesh only")

    def _entries(self) -> tuple[list[_Entry], object]:
        """Every weight and gradient with this rank's part of it, and the one DTensor mesh (None
        when no tensor is a DTensor)."""
        tp_owner = comm.group_rank(self.tp_group) == 0
        tensors = []
        for name, module in self._layers.items():
            sharded = shard_spec_of(module.weight) is not None
            for kind, t in (("weight", module.weight), ("grad", module.weight.grad)):
                tensors.append((f"hist/{name}/{kind}", None if t is None else t.detach(), sharded or tp_owner))
        meshes = {id(t.device_mesh): t.device_mesh for _, t, _ in tensors if t is not None and is_dtensor(t)}
        if len(meshes) > 1:
            raise ValueError(f"DenseLayerHistograms: the dense layers' DTensors live on {len(meshes)} different "
                             "device meshes; histograms reduce over one (the FSDP mesh)")
        mesh = next(iter(meshes.values()), None)
        coordinate = mesh.get_coordinate() if mesh is not None else None
        entries = []
        for tag, t, own in tensors:
            if mesh is not None:
                # Replicas (a Replicate mesh dim, or a plain tensor every FSDP rank holds) count at coordinate 0.
                placements = t.placements if t is not None and is_dtensor(t) else [Replicate()] * mesh.ndim
                own = own and all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))
            entries.append(_Entry(tag, None if t is None else local_tensor(t), own))
        return entries, mesh

    def _all_reduce(self, t: torch.Tensor, mesh, op) -> torch.Tensor:
        comm.all_reduce_(t, self.tp_group, op)
        for dim in range(mesh.ndim if mesh is not None else 0):
            comm.all_reduce_(t, mesh.get_group(dim), op)
        return t

    def collect(self) -> dict[str, Histogram]:
        """``{tag: Histogram}``; a tensor that no rank holds (a gradient not computed) or with a
        non-finite element (a skipped step's gradient) is left out."""
        entries, mesh = self._entries()
        if not entries:
            return {}
        device = next(e.local.device for e in entries if e.local is not None)
        inf = torch.tensor(float("inf"), device=device)
        bounds = []  # this rank's (min, -max) of each tensor; +inf where it holds nothing it counts
        for e in entries:
            if e.own and e.local is not None and e.local.numel():
                bounds.append(torch.stack([e.local.amin().float(), -e.local.amax().float()]))
            else:
                bounds.append(torch.stack([inf, inf]))
        # A NaN element makes its min or max NaN, which a MIN all-reduce need not propagate: -inf does.
        bounds = torch.nan_to_num(torch.stack(bounds), nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
        bounds = self._all_reduce(bounds, mesh, dist.ReduceOp.MIN)
        lo, hi = bounds[:, 0], -bounds[:, 1]
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        # Non-finite bounds would give NaN edges; those tensors are dropped below, after the one read.
        edges = bin_edges(torch.where(finite, lo, 0.0), torch.where(finite, hi, 0.0), self.bins)
        counts = torch.zeros(len(entries), self.bins + 2, dtype=torch.float64, device=device)
        for i, e in enumerate(entries):
            if e.own and e.local is not None and e.local.numel():
                counts[i] = bin_counts(e.local, edges[i])
        counts = self._all_reduce(counts, mesh, dist.ReduceOp.SUM)
        return self._read(entries, lo, hi, finite, edges, counts)

    def _read(self, entries, lo, hi, finite, edges, counts) -> dict[str, Histogram]:
        lo, hi, finite, edges, counts = (x.cpu().tolist() for x in (lo, hi, finite, edges, counts))
        out = {}
        for i, e in enumerate(entries):
            bins = counts[i][: self.bins]
            num = int(sum(bins))
            if finite[i] and num:
                out[e.tag] = Histogram(lo[i], hi[i], num, counts[i][self.bins], counts[i][self.bins + 1],
                                       edges[i], [0.0] + bins)
        return out


__all__ = ["BINS", "DenseLayerHistograms", "Histogram", "bin_counts", "bin_edges"]
