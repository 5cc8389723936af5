"""Magnitude pruning of dense layers, sharded or not, with masks that do not depend on the layout.

    report = bd.prune(model, 0.9)                      # one global threshold over every dense layer
    report = bd.prune(model, None, "n:m", n=2, m=4)    # 2 of every 4 weights along the input dimension
    report = bd.prune(model, 0.5, "rows", layers=["blocks.*.mlp"])   # half the hidden units, layers shrunk
    print(report)

- ``"unstructured"``: the ``round(sparsity * N)`` entries of smallest ``|w|`` over all the named
  layers' N weights go, ties going by global flat index (layers in model order, each row-major): an
  exact selection over all-reduced counts (`bigdense.layers.prune_select`), no weight gathered.
- ``"n:m"``: in every group of ``m`` consecutive weights along the input dimension the ``m - n`` of
  smallest ``(|w|, index)`` go (the pattern of GPUs' 2:4 sparse kernels). Local to each rank; a
  row-parallel layer must split its input on group boundaries.
- ``"rows"``: hidden units of column -> row pairs (`bigdense.layers.prune_rows`): both layers
  shrink, no mask.

``"unstructured"`` and ``"n:m"`` set each layer's ``weight_mask`` (`bigdense.layers.prune_masks`):
pruning again only removes more (an entry a mask removed is the first to go). ``layers`` are
``fnmatch`` patterns of module names; a pattern naming a container (``"blocks.*.mlp"``) takes the
dense layers inside it. By default every dense layer (``nn.Linear``, column and row layers) but
classifier heads: a `ParallelClassifierHead`, or a layer named ``head``, ``lm_head`` or
``classifier``. Collective over the TP group: every TP rank calls it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..errors import check_choice, check_positive_int
from ..parallel import comm
from ..parallel.sharding import ShardSpec
from ..layers.base import TensorParallelModule
from ..layers.head import ParallelClassifierHead
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .prune_masks import mask_of, set_mask_
from .prune_rows import find_pairs, shrink_pair
from .prune_select import BLOCK, Candidate, magnitude_keys, select_smallest

STRUCTURES = ("unstructured", "n:m", "rows")
HEAD_NAMES = ("head", "lm_head", "classifier")
DENSE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


@dataclass
class PruneReport:
    """What `prune` did. ``layers``: name -> (kept, total) weight entries (hidden units for
    ``"rows"``), global counts; ``threshold``: the largest ``|w|`` pruned (``"unstructured"``; None
    when nothing went); ``new_sizes``: ``"rows"``, name -> (hidden size before, after)."""

    structure: str
    sparsity: Optional[float]
    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    threshold: Optional[float] = None
    new_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return sum(k for k, _ in self.layers.values())

    @property
    def total(self) -> int:
        return sum(t for _, t in self.layers.values())

    @property
    def achieved(self) -> float:
        """The fraction of the layers' entries (units) that is pruned."""
        return 1.0 - self.kept / self.total if self.total else 0.0

    def __str__(self) -> str:
        unit = "units" if self.structure == "rows" else "weights"
        lines = [f"prune {self.structure}: {self.total - self.kept:,} of {self.total:,} {unit} pruned "
                 f"({self.achieved:.2%}) over {len(self.layers)} layers"
                 + (f", threshold |w| <= {self.threshold:.4g}" if self.threshold is not None else "")]
        width = max((len(name) for name in self.layers), default=0)
        for name, (kept, total) in self.layers.items():
            before, after = self.new_sizes.get(name, (None, None))
            size = f"  d_hidden {before} -> {after}" if name in self.new_sizes else ""
            lines.append(f"  {name:<{width}}  {kept:>12,} / {total:<12,} kept{size}")
        return "\n".join(lines)


def prune(model_or_layer: nn.Module, sparsity: Optional[float], structure: str = "unstructured", *,
          layers: Optional[Sequence[str]] = None, n: int = 2, m: int = 4) -> PruneReport:
    """Prune ``model_or_layer`` (a dense layer, a `ParallelMLP`, a model) in place; see the module
    docstring. ``sparsity``: the fraction in [0, 1] to remove (``"n:m"``: None or ``1 - n/m``)."""
    check_choice("prune: structure", structure, STRUCTURES, ValueError)
    sparsity = check_sparsity(sparsity, structure, n, m)
    report = PruneReport(structure, sparsity)
    if structure == "rows":
        _prune_rows(model_or_layer, sparsity, layers, report)
        return report
    targets = dense_layers(model_or_layer, layers)
    if not targets:
        raise TypeError(f"prune: {type(model_or_layer).__name__} holds no dense layer to prune (nn.Linear, "
                        f"ColumnParallelLinear, RowParallelLinear; classifier heads only when named in layers)")
    if structure == "n:m":
        _prune_n_m(targets, n, m, report)
    else:
        _prune_unstructured(targets, sparsity, report)
    return report


def attach_masks(model: nn.Module, layers: Optional[Sequence[str]] = None) -> list[str]:
    """Give the named layers (`prune`'s ``layers``) an all-True ``weight_mask`` where they have none,
    so that a pruned model's checkpoint loads into ``model``. Not a collective. Returns the names."""
    names = []
    for name, layer in dense_layers(model, layers):
        if mask_of(layer) is None:
            set_mask_(layer, torch.ones_like(layer.weight, dtype=torch.bool))
        names.append(name)
    return names


def check_sparsity(sparsity, structure: str, n: int, m: int) -> float:
    if structure == "n:m":
        check_positive_int("prune: m", m)
        if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n < m):
            raise ValueError(f"prune: n:m needs an integer n with 0 < n < m, got n={n!r}, m={m}")
        if sparsity is not None and not (isinstance(sparsity, (int, float)) and math.isclose(sparsity, 1 - n / m)):
            raise ValueError(f"prune: n:m with n={n}, m={m} prunes exactly 1 - n/m = {1 - n / m:g} of the weights; "
                             f"pass sparsity=None (or {1 - n / m:g}), got {sparsity!r}")
        return 1 - n / m
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity <= 1:
        raise ValueError(f"prune: sparsity must be a number in [0, 1] for structure={structure!r}, got {sparsity!r}")
    return float(sparsity)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def _is_default(name: str, layer: nn.Module) -> bool:
    return not isinstance(layer, ParallelClassifierHead) and name.rpartition(".")[2] not in HEAD_NAMES


def dense_layers(root: nn.Module, patterns: Optional[Sequence[str]] = None) -> list[tuple[str, nn.Module]]:
    """The dense layers ``patterns`` name in ``root``, in model order (see the module docstring)."""
    if patterns is None and isinstance(root, DENSE):
        return [(type(root).__name__, root)]
    patterns = [patterns] if isinstance(patterns, str) else patterns
    found: dict[int, tuple[str, nn.Module]] = {}
    unmatched = list(patterns or ())
    for name, module in root.named_modules():
        if patterns is None:
            if isinstance(module, DENSE) and _is_default(name, module):
                found[id(module)] = (name, module)
            continue
        if not _matches(name, patterns):
            continue
        unmatched = [p for p in unmatched if not fnmatchcase(name, p)]
        inside = [(f"{name}.{sub}" if sub else name, m) for sub, m in module.named_modules()]
        dense = [(n_, m) for n_, m in inside if isinstance(m, DENSE) and (m is module or _is_default(n_, m))]
        if not dense:
            raise TypeError(f"prune: layers pattern matches {name!r}, a {type(module).__name__} that holds no "
                            f"nn.Linear, ColumnParallelLinear or RowParallelLinear")
        for n_, m in dense:
            found.setdefault(id(m), (n_, m))
    if unmatched:
        raise ValueError(f"prune: layers pattern {unmatched[0]!r} matches no module of {type(root).__name__}")
    return list(found.values())


def weight_spec(layer: nn.Module) -> Optional[ShardSpec]:
    """How the weight is split over TP; None when it is whole on every rank."""
    if isinstance(layer, TensorParallelModule) and layer.tp_size > 1:
        return layer.shard_spec("weight")
    return None


def _global_positions(spec: Optional[ShardSpec], dim: int, local: int, device) -> torch.Tensor:
    """Global coordinate along ``dim`` of each local coordinate."""
    if spec is None or spec.dim != dim:
        return torch.arange(local, device=device)
    return torch.cat([torch.arange(g, g + n, device=device) for _, g, n in spec.boxes()])


def _candidate(layer: nn.Module, base: int) -> Candidate:
    """``layer``'s share of a global selection; its entries' flat indices start at ``base``."""
    spec, weight = weight_spec(layer), layer.weight
    cols_global = spec.global_shape[1] if spec is not None else weight.shape[1]
    rows = _global_positions(spec, 0, weight.shape[0], weight.device)
    cols = _global_positions(spec, 1, weight.shape[1], weight.device)
    return Candidate(weight.detach(), mask_of(layer),
                     lambda r, c: base + rows[r] * cols_global + cols[c], replicated=spec is None)


def _tp_group(targets):
    """The one TP group the sharded targets are split over (None when none is sharded)."""
    groups = {id(layer.tp_group): layer.tp_group for _, layer in targets if weight_spec(layer) is not None}
    if len(groups) > 1:
        raise ValueError(f"prune: the layers {[n for n, _ in targets]} are sharded over different TP groups; "
                         f"prune each group's layers with its own call")
    return next(iter(groups.values()), None)


def _global_numel(layer: nn.Module) -> int:
    spec = weight_spec(layer)
    return math.prod(spec.global_shape) if spec is not None else layer.weight.numel()


def _prune_unstructured(targets, sparsity: float, report: PruneReport) -> None:
    group, candidates, total = _tp_group(targets), [], 0
    for _, layer in targets:
        candidates.append(_candidate(layer, total))
        total += _global_numel(layer)
    k = math.floor(sparsity * total + 0.5)  # round half up
    selection = select_smallest(candidates, k, total, group) if k > 0 else None
    for c, (_, layer) in zip(candidates, targets):
        keep = selection.keep_mask(c) if selection is not None else torch.ones_like(layer.weight, dtype=torch.bool)
        if c.mask is not None:
            keep &= c.mask  # masks only grow
        set_mask_(layer, keep)
    report.threshold = None if selection is None else selection.threshold
    _count(targets, report, group)


def _prune_n_m(targets, n: int, m: int, report: PruneReport) -> None:
    """Keep the ``n`` of largest ``(|w|, index)`` in each group of ``m`` along the input dimension."""
    group = _tp_group(targets)
    for name, layer in targets:
        check_n_m_layout(name, layer, weight_spec(layer), m)
    for _, layer in targets:
        weight, mask = layer.weight.detach(), mask_of(layer)
        rows = max(1, BLOCK // max(1, weight.shape[1]))
        blocks = []
        for start in range(0, weight.shape[0], rows):
            part = magnitude_keys(weight[start:start + rows], None if mask is None else mask[start:start + rows])
            keys = part.long().view(part.shape[0], -1, m) * m + torch.arange(m, device=weight.device)
            keep = torch.ones(keys.shape, dtype=torch.bool, device=weight.device)
            blocks.append(keep.scatter_(-1, keys.argsort(dim=-1)[..., : m - n], False).view(part.shape))
        keep = torch.cat(blocks) if blocks else torch.ones_like(weight, dtype=torch.bool)
        set_mask_(layer, keep if mask is None else keep & mask)
    _count(targets, report, group)


def _count(targets, report: PruneReport, group) -> None:
    """Global (kept, total) per layer: one all-reduce of the sharded layers' local counts."""
    device = targets[0][1].weight.device
    sharded = [i for i, (_, layer) in enumerate(targets) if weight_spec(layer) is not None]
    kept = [int(mask_of(layer).sum()) for _, layer in targets]
    if sharded:
        summed = comm.all_reduce_(torch.tensor([kept[i] for i in sharded], dtype=torch.int64, device=device), group)
        for i, value in zip(sharded, summed.tolist()):
            kept[i] = value
    for (name, layer), value in zip(targets, kept):
        report.layers[name] = (value, _global_numel(layer))


def check_n_m_layout(name: str, layer: nn.Module, spec: Optional[ShardSpec], m: int) -> None:
    """Groups of ``m`` along the input dimension must be whole on every rank (the same check on all)."""
    in_features = spec.global_shape[1] if spec is not None else layer.weight.shape[1]
    if in_features % m:
        raise ValueError(f"prune n:m: {name} ({type(layer).__name__}) has in_features={in_features}, not a multiple "
                         f"of m={m}")
    if spec is not None and spec.dim == 1:
        ranks = [ShardSpec(1, spec.global_shape, spec.sizes, r, spec.group, spec.parts) for r in range(len(spec.sizes))]
        if any(g % m or length % m for r in ranks for _, g, length in r.boxes()):
            raise ValueError(f"prune n:m: {name} ({type(layer).__name__}) splits in_features={in_features} over "
                             f"tp={len(spec.sizes)} into shards of {list(spec.sizes)}, which cuts groups of m={m}; "
                             f"use a TP size that splits it into multiples of {m}, or prune the unsharded layer")


def _prune_rows(root: nn.Module, fraction: float, patterns, report: PruneReport) -> None:
    if isinstance(patterns, str):
        patterns = [patterns]
    pairs = find_pairs(root, None if patterns is None else (lambda name: _matches(name, patterns)))
    for pattern in patterns or ():
        if not any(fnmatchcase(p.name, pattern) or fnmatchcase(p.container, pattern) for p in pairs):
            raise ValueError(f"prune rows: layers pattern {pattern!r} names no column -> row pair of "
                             f"{type(root).__name__} (a ParallelMLP, or consecutive linear layers of an nn.Sequential)")
    if not pairs:
        raise TypeError(f"prune rows: {type(root).__name__} holds no column -> row pair (a ParallelMLP, or "
                        f"consecutive linear layers of an nn.Sequential)")
    for pair in pairs:
        before, after = shrink_pair(pair, fraction)
        report.layers[pair.name] = (after, before)
        report.new_sizes[pair.name] = (before, after)
