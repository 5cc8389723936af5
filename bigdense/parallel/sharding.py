"""How a global dimension is split over the ranks of a tensor-parallel group.

Every bigdense layer splits a dimension the same way: the first ``total % parts`` ranks hold one
more row (or column) than the rest, so shards never differ by more than one. A Column→Row pair
built with the same ``total`` therefore agrees on every rank's slice of the hidden dimension.

`ShardSpec` records, for one parameter, which global tensor it is a slice of. Layers report theirs
through ``module.bd_shard_specs()``; clipping, checkpointing and export read them from there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def shard_sizes(total: int, parts: int) -> list[int]:
    """Balanced split of ``total`` into ``parts`` sizes: ``[3, 3, 2, 2]`` for ``(10, 4)``."""
    if parts < 1:
        raise ValueError(f"shard_sizes: parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"shard_sizes: total must be >= 0, got {total}")
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of shard ``index`` in the balanced split of ``total`` into ``parts``."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardSpec:
    """This rank's parameter is ``global[..., start:stop, ...]`` along ``dim`` of ``global_shape``.

    ``sizes`` is the length along ``dim`` on every rank of the TP group, in rank order, so a reader
    can place any rank's shard without asking that rank.
    """

    dim: int
    global_shape: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = self.sizes[self.rank]
        return tuple(shape)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        return full.narrow(self.dim, self.start, self.sizes[self.rank])

    @classmethod
    def balanced(cls, global_shape, dim: int, parts: int, rank: int) -> "ShardSpec":
        global_shape = tuple(int(s) for s in global_shape)
        return cls(dim, global_shape, tuple(shard_sizes(global_shape[dim], parts)), rank)


def mark_tensor_parallel(param: torch.nn.Parameter, spec: ShardSpec) -> None:
    """Tag a sharded parameter the way Megatron does, for libraries that read those attributes.

    DeepSpeed's gradient-norm code counts a parameter on every model-parallel rank only when
    ``tensor_model_parallel`` is set; bigdense itself reads ``bd_shard_specs()`` instead.
    """
    param.tensor_model_parallel = True
    param.partition_dim = spec.dim
    param.partition_stride = 1
