"""Sparse products for pruned layers, at inference, where they are faster.

    report = bd.to_sparse(model)                 # every pruned layer whose sparse product is faster
    model = report.module                        # (the same model, changed in place)
    sparse = bd.SparseLinear(pruned_layer)       # one layer, unconditionally

A pruned layer (`bd.prune`: a ``weight_mask`` buffer, its pruned weights zero) holds the same
products as a sparse matrix. `SparseLinear` keeps the layer's interface and communication
(`bigdense.compression.inference`) and multiplies this rank's shard in one of `FORMATS`:

* ``"csr"``: compressed sparse rows (``torch.sparse``), computed as ``(W x^T)^T`` with
  ``torch.sparse.mm``, on any device. (On CPU that form measured 1.2-2.9x faster than
  ``F.linear(x, W_csr)`` at 16-512 rows of a 4,096 x 4,096 weight at 90% sparsity, and the same
  at one row.)
* ``"semi_structured"``: 2:4 sparsity (two nonzeros in each group of four inputs, `bd.prune`'s
  ``structure="n:m"``) in the GPUs' sparse tensor cores (``torch.sparse.to_sparse_semi_structured``;
  CUDA, compute capability 8.0 or later, half precision). Elsewhere it is refused with the reason.
  Whether a shard can be 2:4 depends on the shard (whole groups of four inputs, its pattern, torch's
  size limits), so the ranks of a sharded layer agree first (one tiny all-reduce): when any rank's
  shard is refused, every rank raises, naming the ranks refused.

A rank whose shard is empty (an uneven split of fewer features than ranks) keeps it as it is, in
either format: `InferenceLinear` computes its zeros and never multiplies by it.

Sparse products sum the same nonzero terms as the masked dense product, in another order: outputs
agree to float rounding, not bit for bit. A sparse layer's weight is not saved (``state_dict``
holds its bias only): save the pruned model, and convert after loading.

`to_sparse` times the dense and each possible sparse product of every pruned layer on a sample
input and converts a layer only when the best is at least ``min_speedup`` times faster. The
timings are all-reduced (MAX) over the layer's TP group before deciding, so every rank decides the
same, and a format that fails on any rank is out everywhere.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import check_choice
from ..parallel import comm
from ..parallel.context import resolve_tp_group
from ..layers.base import replace_module
from .inference import InferenceLinear, dense_kind, is_dense, masked_weight, matching_layers
from .prune_masks import mask_of

FORMATS = ("csr", "semi_structured")
SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)


def semi_structured_refusal(weight: torch.Tensor) -> Optional[str]:
    """Why ``weight`` (out, in) cannot be 2:4 semi-structured here; None when it can be tried (an
    empty shard: when the device and dtype could be, as there is nothing to convert)."""
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return "this torch has no torch.sparse.to_sparse_semi_structured"
    if weight.device.type != "cuda":
        return f"2:4 sparse kernels need a CUDA device, the weight is on {weight.device}"
    if torch.cuda.get_device_capability(weight.device) < (8, 0):
        return f"2:4 sparse kernels need compute capability 8.0 or later, {weight.device} has " \
               f"{torch.cuda.get_device_capability(weight.device)}"
    if weight.dtype not in SEMI_STRUCTURED_DTYPES:
        return f"2:4 sparse kernels take {SEMI_STRUCTURED_DTYPES}, the weight is {weight.dtype}"
    if weight.numel() == 0:
        return None
    if weight.shape[1] % 4:
        return f"this rank's {weight.shape[1]} inputs are not whole groups of 4"
    if bool(((weight.reshape(weight.shape[0], weight.shape[1] // 4, 4) != 0).sum(-1) > 2).any()):
        return "the weight is not 2:4 sparse along its inputs (prune it with structure='n:m')"
    return None


def _converted(weight: torch.Tensor, format: str) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(``weight`` in ``format``, None), or (None, why torch refused it)."""
    try:
        if format == "semi_structured":
            return torch.sparse.to_sparse_semi_structured(weight.contiguous()), None
        with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", at every conversion
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
            return weight.to_sparse_csr(), None
    except (RuntimeError, ValueError) as err:
        return None, f"torch refused this rank's {tuple(weight.shape)} shard: {str(err).splitlines()[0][:200]}"


class SparseLinear(InferenceLinear):
    """A pruned dense layer whose local product is sparse (see the module docstring): the layer's
    interface, shapes and communication. ``weight``: this rank's masked ``(out_local, in_local)``
    weight in ``format`` (not saved); ``density``: its fraction of nonzeros on this rank. `to_dense`
    gives the layer of its kept weights. Building a ``"semi_structured"`` one of a sharded layer
    is a collective (the ranks agree that each can hold its shard)."""

    def __init__(self, layer: nn.Module, format: str = "csr"):
        super().__init__(layer, "SparseLinear")
        self.format = check_choice("SparseLinear: format", format, FORMATS, ValueError)
        self._store_weight(masked_weight(layer))

    def _store_weight(self, weight: torch.Tensor) -> None:
        refusal = semi_structured_refusal(weight) if self.format == "semi_structured" else None
        stored = weight  # an empty shard stays as it is: `InferenceLinear` never multiplies by it
        if refusal is None and self.holds_weight:
            stored, refusal = _converted(weight, self.format)
        if self.format == "semi_structured":
            self._agree_on_format(refusal, weight.device)
        elif refusal is not None:  # (CSR takes any shard: only torch itself could refuse one)
            raise ValueError(f"SparseLinear(format={self.format!r}) of {self._where()}: {refusal}")
        self.density = float((weight != 0).sum()) / max(1, weight.numel())
        self.register_buffer("weight", stored, persistent=False)

    def _agree_on_format(self, refusal: Optional[str], device: torch.device) -> None:
        """Raise on every rank of the TP group when any rank's shard is refused in this format."""
        refused = torch.zeros(self.tp_size, device=device)
        refused[self.tp_rank] = float(refusal is not None)
        if self.kind != "linear":
            comm.all_reduce_(refused, self.tp_group, op=dist.ReduceOp.MAX)
        ranks = refused.nonzero().flatten().tolist()
        if not ranks:
            return
        who = f"SparseLinear(format={self.format!r}) of {self._where()}"
        if self.kind == "linear" or self.tp_size == 1:
            raise ValueError(f"{who}: {refusal}")
        mine = f"this rank: {refusal}" if refusal else "this rank's shard could be converted"
        raise ValueError(f"{who}: refused on TP rank(s) {ranks} ({mine})")

    def _reference_tensor(self) -> torch.Tensor:
        return self.weight

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "semi_structured":
            return F.linear(x, self.weight)
        return torch.sparse.mm(self.weight, x.t()).t()

    def _dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format!r}, density on this rank={self.density:.3f}"


@dataclass
class SparseReport:
    """What `to_sparse` did: ``module`` (the model, changed in place; for a single layer, the layer
    to use, sparse or the original) and one row per pruned layer: its name, the whole layer's
    density, the dense and each format's forward time (ms, the slowest rank's), the chosen format
    (None: kept dense) and why a format was out."""

    module: nn.Module
    layers: list[dict] = field(default_factory=list)


def median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    """Median time of ``fn(x)`` in ms after one warm-up call (a GPU synchronised around each)."""
    fn(x)  # warm-up
    times = []
    for _ in range(repeats):
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        fn(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _candidates(device: torch.device) -> tuple[str, ...]:
    return ("semi_structured", "csr") if device.type == "cuda" else ("csr",)


def _is_pruned(layer: nn.Module) -> bool:
    return is_dense(layer) and mask_of(layer) is not None


def _local_times(layer: nn.Module, weight: torch.Tensor, formats, x: torch.Tensor, repeats: int):
    """On this rank: ([dense ms, each format's ms (inf where it failed)], {format: SparseLinear}, {format: why not})."""
    built, refused, times = {}, {}, [median_ms(lambda t: F.linear(t, weight), x, repeats)]
    for fmt in formats:
        try:
            built[fmt] = SparseLinear(layer, fmt)
            times.append(median_ms(built[fmt]._local, x, repeats))  # (the shared path: an empty shard too)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
            refused[fmt] = str(err).splitlines()[0][:200]
            built.pop(fmt, None)
            times.append(float("inf"))
    return times, built, refused


@torch.no_grad()
def _decide(name: str, layer: nn.Module, group, min_speedup: float, sample_tokens: int, repeats: int):
    """(row, the chosen SparseLinear or None) for one pruned layer; collective over ``group``."""
    weight = masked_weight(layer)
    # The same sample on every rank (its values do not matter, only its shape).
    x = torch.randn(sample_tokens, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(device=weight.device, dtype=weight.dtype)
    formats = _candidates(weight.device)
    times, built, refused = _local_times(layer, weight, formats, x, repeats)
    slowest = comm.all_reduce_(torch.tensor(times, dtype=torch.float64, device=weight.device), group,
                               op=dist.ReduceOp.MAX).tolist()
    dense_ms, sparse_ms = slowest[0], dict(zip(formats, slowest[1:]))
    best = min(formats, key=lambda f: sparse_ms[f])
    chosen = best if sparse_ms[best] * min_speedup <= dense_ms else None
    # The whole layer's density: nonzeros and entries summed over the ranks (a replicated layer's alike).
    counts = comm.all_reduce_(torch.tensor([float((weight != 0).sum()), float(weight.numel())], dtype=torch.float64,
                                           device=weight.device), group)
    failed = [f for f, ms in sparse_ms.items() if ms == float("inf")]
    row = {"layer": name, "type": type(layer).__name__, "density": float(counts[0] / counts[1]) if counts[1] else 0.0,
           "sample_tokens": sample_tokens, "dense_ms": dense_ms,
           **{f"{f}_ms": (None if f in failed else ms) for f, ms in sparse_ms.items()},
           "format": chosen, "speedup": 0.0 if best in failed else dense_ms / sparse_ms[best],
           "refused": {f: refused.get(f, "failed on another rank") for f in failed}}
    return row, (built[chosen] if chosen else None)


def to_sparse(
    module: nn.Module,
    *,
    min_speedup: float = 1.0,
    sample_tokens: int = 128,
    repeats: int = 5,
    layers: Optional[list[str]] = None,
    tp_group=None,
) -> SparseReport:
    """Replace each pruned layer of ``module`` (or ``module`` itself, when it is one) by its
    `SparseLinear` where that is at least ``min_speedup`` times faster on ``sample_tokens`` rows
    (median of ``repeats``, the slowest rank's); see the module docstring.

    ``layers``: fnmatch patterns of the module names to consider (default: every pruned
    ``nn.Linear``, `ColumnParallelLinear`, `RowParallelLinear`). ``tp_group``: where a replicated
    ``nn.Linear``'s ranks agree (default: the default context's TP group), so that replicated
    activations stay identical; a parallel layer agrees over its own group. Collective.
    """
    if not min_speedup > 0:
        raise ValueError(f"to_sparse: min_speedup must be > 0, got {min_speedup!r}")
    if not (isinstance(sample_tokens, int) and sample_tokens >= 1 and isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"to_sparse: sample_tokens and repeats must be positive integers, "
                         f"got {sample_tokens!r}, {repeats!r}")
    targets = matching_layers(module, layers, _is_pruned)
    if not targets:
        raise ValueError(f"to_sparse: no pruned layer (one with a weight_mask: bd.prune) in {type(module).__name__}"
                         + (f" matches layers={layers}" if layers is not None else ""))
    default_group = resolve_tp_group(tp_group)
    report = SparseReport(module)
    for name, layer in targets:
        group = default_group if dense_kind(layer, "to_sparse") == "linear" else layer.tp_group
        row, sparse = _decide(name, layer, group, min_speedup, sample_tokens, repeats)
        report.layers.append(row)
        if sparse is not None:
            report.module = replace_module(report.module, name, sparse)
    return report
