"""Structured pruning of hidden units: a column -> row pair loses whole units and both layers shrink.

A pair is a module with ``up`` (and ``gate``) and ``down`` dense layers (`ParallelMLP`, `DenseMLP`,
the GPT's ``blocks.*.mlp``), or two linear layers of an ``nn.Sequential`` with only parameter-free
modules between them (activations, dropout): the column -> row pairs `bd.parallelize` converts.
Sharded, the inputs are `ColumnParallelLinear` and the output a `RowParallelLinear` over one TP
group; unsharded, ``nn.Linear`` all three.

Unit ``j``'s score is the product of the L2 norms of its row in each input projection and of its
column in ``down`` (biases are not scored). The rank holding the unit computes it whole, in
float64, rounded to float32, so it is the same number at every TP size; the ``round(fraction * h)``
units of smallest ``(score, index)`` go. The new layers hold the kept units in their order, split
over TP by the balanced rule like any layer of the new size, so units move between ranks: in blocks
of `BLOCK` values, each new unit is summed over TP from the one rank that holds it (an exact copy,
no weight gathered). The input projections' biases and any ``weight_mask`` move with their units;
``down``'s bias stays. The shrunk pair computes what the pair computes with the pruned units' outputs
removed. Build the optimizer (or engine) after: the layers are new modules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..parallel import comm
from ..parallel.sharding import mark_sharded, shard_sizes
from ..layers.base import TensorParallelModule
from ..layers.dropout import ShardedDropout
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .prune_masks import mask_of, set_mask_
from .prune_select import BLOCK

_DENSE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


@dataclass
class Pair:
    """``owner`` (named ``container``)'s attributes ``inputs`` (gate and/or up) feed ``output`` (down)
    through hidden units; ``between``: the modules in between (a `ShardedDropout` there follows the
    new split). ``name``: the MLP's, or a Sequential pair's first layer's."""

    name: str
    container: str
    owner: nn.Module
    inputs: list[str]
    output: str
    between: list[nn.Module] = field(default_factory=list)

    def layer(self, attr: str) -> nn.Module:
        return getattr(self.owner, attr)


def _is_mlp(module: nn.Module) -> bool:
    parts = [getattr(module, a, None) for a in ("up", "down")]
    gate = getattr(module, "gate", None)
    return all(isinstance(p, _DENSE) for p in parts) and (gate is None or isinstance(gate, _DENSE))


def find_pairs(root: nn.Module, wanted: Optional[Callable[[str], bool]]) -> list[Pair]:
    """Every pair of ``root`` in model order whose name ``wanted`` accepts (all when None). A
    Sequential pair is named by its first layer, and wanted when that or the Sequential's name is."""
    pairs = []
    for name, module in root.named_modules():
        if _is_mlp(module) and (wanted is None or wanted(name)):
            inputs = ["gate", "up"] if getattr(module, "gate", None) is not None else ["up"]
            pairs.append(Pair(name or type(module).__name__, name, module, inputs, "down"))
        elif isinstance(module, nn.Sequential):
            pairs.extend(p for p in _sequential_pairs(name, module)
                         if wanted is None or wanted(name) or wanted(p.name))
    return pairs


def _sequential_pairs(name: str, seq: nn.Sequential) -> list[Pair]:
    children, pairs, i = list(seq.named_children()), [], 0
    while i < len(children):
        first_name, first = children[i]
        j = i + 1
        while j < len(children) and not isinstance(children[j][1], _DENSE) and not any(children[j][1].parameters()):
            j += 1
        if isinstance(first, _DENSE) and j < len(children) and isinstance(children[j][1], _DENSE):
            full = f"{name}.{first_name}" if name else first_name
            pairs.append(Pair(full, name, seq, [first_name], children[j][0], [m for _, m in children[i + 1:j]]))
            i = j + 1
        else:
            i += 1
    return pairs


def _check_pair(pair: Pair) -> tuple[list[nn.Module], nn.Module]:
    inputs, output = [pair.layer(a) for a in pair.inputs], pair.layer(pair.output)
    sharded = (all(type(x) is ColumnParallelLinear and not x.gather_output for x in inputs)
               and type(output) is RowParallelLinear and output.input_is_parallel
               and all(x.tp_group is output.tp_group for x in inputs))
    plain = all(type(x) is nn.Linear for x in [*inputs, output])
    kinds = [type(x).__name__ for x in [*inputs, output]]
    if not (sharded or plain):
        raise TypeError(f"prune rows: {pair.name} is {' -> '.join(kinds)}; a pair is ColumnParallelLinear "
                        f"(gather_output=False) -> RowParallelLinear (input_is_parallel=True) on one TP group, or "
                        f"nn.Linear -> nn.Linear")
    hidden = {x.out_features for x in inputs} | {output.in_features}
    if len(hidden) != 1:
        raise ValueError(f"prune rows: {pair.name}: hidden sizes differ between {' -> '.join(kinds)}: {sorted(hidden)}")
    return inputs, output


def _unit_scores(inputs: list[nn.Module], output: nn.Module) -> torch.Tensor:
    """This rank's units' scores (float64 norms, rounded to float32: layout-free)."""
    score = output.weight.detach().double().pow(2).sum(0).sqrt()
    for layer in inputs:
        score = score * layer.weight.detach().double().pow(2).sum(1).sqrt()
    return score.float()


@torch.no_grad()
def shrink_pair(pair: Pair, fraction: float) -> tuple[int, int]:
    """Remove the lowest-scoring ``fraction`` of ``pair``'s hidden units (collective over its TP
    group). Returns (hidden size before, after)."""
    inputs, output = _check_pair(pair)
    group = output.tp_group if isinstance(output, TensorParallelModule) and output.tp_size > 1 else None
    hidden = output.in_features
    old_sizes = output.partition_sizes if group is not None else [hidden]
    scores = comm.all_gather_dim(_unit_scores(inputs, output), 0, group, old_sizes)
    drop = math.floor(fraction * hidden + 0.5)
    if drop >= hidden:
        raise ValueError(f"prune rows: sparsity {fraction} removes all {hidden} hidden units of {pair.name}; "
                         f"keep at least one")
    keep = torch.sort(torch.sort(scores, stable=True).indices[drop:]).values
    move = _Mover(keep, old_sizes, group)
    for attr, layer in zip(pair.inputs, inputs):
        tensors = {"weight": (layer.weight, 0), "bias": (layer.bias, 0), "mask": (mask_of(layer), 0)}
        new = _rebuilt(layer, layer.in_features, len(keep))
        _fill(new, layer, {k: None if t is None else move(t, d) for k, (t, d) in tensors.items()})
        setattr(pair.owner, attr, new)
    new = _rebuilt(output, len(keep), output.out_features)
    _fill(new, output, {"weight": move(output.weight, 1), "bias": output.bias,
                        "mask": None if mask_of(output) is None else move(mask_of(output), 1)})
    setattr(pair.owner, pair.output, new)
    if hasattr(pair.owner, "d_hidden"):
        pair.owner.d_hidden = len(keep)
    first = pair.layer(pair.inputs[0])
    for module in pair.between:
        if isinstance(module, ShardedDropout):
            module.global_size, module.offset = len(keep), getattr(first, "partition_start", 0)
    return hidden, len(keep)


class _Mover:
    """This rank's slice of the kept units of a tensor whose ``dim`` runs over the hidden units."""

    def __init__(self, keep: torch.Tensor, old_sizes: list[int], group):
        self.keep, self.group = keep, group
        rank, tp = comm.group_rank(group), len(old_sizes)
        self.old_start, self.old_size = sum(old_sizes[:rank]), old_sizes[rank]
        new_sizes = shard_sizes(len(keep), tp)
        self.new_start, self.new_size = sum(new_sizes[:rank]), new_sizes[rank]

    def __call__(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        front = local.detach().movedim(dim, 0)
        keep = self.keep.to(front.device)
        if self.group is None:
            return front.index_select(0, keep).movedim(0, dim).contiguous()
        # float32 carries bool, bf16 and fp16 values exactly; x + 0 + ... + 0 == x.
        carrier = torch.float64 if front.dtype == torch.float64 else torch.float32
        out = front.new_empty((self.new_size, *front.shape[1:]))
        rows = max(1, BLOCK // max(1, math.prod(front.shape[1:])))
        for start in range(0, len(keep), rows):
            ids = keep[start:start + rows]
            here = (ids >= self.old_start) & (ids < self.old_start + self.old_size)
            block = torch.zeros((len(ids), *front.shape[1:]), dtype=carrier, device=front.device)
            block[here] = front[ids[here] - self.old_start].to(carrier)
            comm.all_reduce_(block, self.group)
            lo, hi = max(start, self.new_start), min(start + len(ids), self.new_start + self.new_size)
            if hi > lo:
                out[lo - self.new_start:hi - self.new_start] = block[lo - start:hi - start].to(out.dtype)
        return out.movedim(0, dim).contiguous()


def _rebuilt(layer: nn.Module, in_features: int, out_features: int) -> nn.Module:
    """An empty layer like ``layer`` (same class, options, group, device, dtype) of a new size."""
    kw = dict(bias=layer.bias is not None, device="meta", dtype=layer.weight.dtype)
    with torch.random.fork_rng(devices=[]):  # a constructor draws its seed: leave torch's generator as it was
        if isinstance(layer, ColumnParallelLinear):
            new = ColumnParallelLinear(in_features, out_features, gather_output=layer.gather_output,
                                       sequence_parallel=layer.sequence_parallel, overlap_comm=layer.overlap_comm,
                                       init=layer.init, tp_group=layer.tp_group, **kw)
        elif isinstance(layer, RowParallelLinear):
            new = RowParallelLinear(in_features, out_features, input_is_parallel=layer.input_is_parallel,
                                    sequence_parallel=layer.sequence_parallel, init=layer.init,
                                    tp_group=layer.tp_group, **kw)
        else:
            new = nn.Linear(in_features, out_features, **kw)
    # Storage for the values `_fill` copies in (not `to_empty`, whose meta path costs a second of imports).
    for name, p in list(new.named_parameters(recurse=False)):
        setattr(new, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=layer.weight.device)))
    if isinstance(new, TensorParallelModule):
        new._weight_seed = layer._weight_seed
        for name, spec in new.bd_shard_specs().items():
            mark_sharded(getattr(new, name), spec)
    return new


def _fill(new: nn.Module, old: nn.Module, values: dict) -> None:
    new.weight.copy_(values["weight"])
    new.weight.requires_grad_(old.weight.requires_grad)
    if new.bias is not None:
        new.bias.copy_(values["bias"])
        new.bias.requires_grad_(old.bias.requires_grad)
    if values["mask"] is not None:
        set_mask_(new, values["mask"].bool())
