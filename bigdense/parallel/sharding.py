"""How a global dimension is split over the ranks of a tensor-parallel group.

Every bigdense layer splits a dimension the same way: the first ``total % parts`` ranks hold one
more row (or column) than the rest, so shards never differ by more than one. A Column→Row pair
built with the same ``total`` therefore agrees on every rank's slice of the hidden dimension.

`ShardSpec` records, for one parameter, which global tensor it is a slice of. A layer declares it
once per parameter (`TensorParallelModule._declare_shard`), which is the one place "is this
parameter sharded, and how" is decided. It is then read two ways: per module through
``module.bd_shard_specs()`` (checkpoints, export, parameter counts) and per parameter through
`shard_spec_of` (gradient clipping, RMS metrics, which see parameters rather than modules).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

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

    ``sizes`` is the length along ``dim`` on every rank of the group the tensor is split over, in
    rank order, so a reader can place any rank's shard without asking that rank. ``group`` says
    which group that is: ``"tp"`` (the TP group; DP ranks hold replicas) or ``"world"`` (every rank
    of the TP x DP mesh, ``rank`` being the world rank ``dp_rank * tp + tp_rank``; no replicas, so
    data parallelism must not reduce it).

    ``parts`` > 1: ``dim`` packs that many equal blocks (a fused ``[gate; up]`` projection), each
    split over the ranks on its own by ``sizes``; this rank's tensor is its slice of every block,
    concatenated in block order (`boxes`), so it is not one slice of the global tensor.
    """

    dim: int
    global_shape: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    group: str = "tp"
    parts: int = 1

    @property
    def start(self) -> int:
        """Where this rank's slice starts within each block (within the tensor when ``parts`` is 1)."""
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def block(self) -> int:
        """The length of one packed block along ``dim`` (the whole length when ``parts`` is 1)."""
        return self.global_shape[self.dim] // self.parts

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = self.sizes[self.rank] * self.parts
        return tuple(shape)

    def boxes(self) -> list[tuple[int, int, int]]:
        """``(local start, global start, length)`` along ``dim`` of each slice this rank holds."""
        n = self.sizes[self.rank]
        return [(j * n, j * self.block + self.start, n) for j in range(self.parts)]

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view when ``parts`` is 1)."""
        if self.parts == 1:
            return full.narrow(self.dim, self.start, self.sizes[self.rank])
        return torch.cat([full.narrow(self.dim, g, n) for _, g, n in self.boxes()], self.dim)

    def assemble(self, every_rank: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's local tensor, in rank order (the inverse of `slice_of`)."""
        if self.parts == 1:
            return torch.cat(every_rank, self.dim)
        blocks = [[t.narrow(self.dim, j * n, n) for t, n in zip(every_rank, self.sizes)] for j in range(self.parts)]
        return torch.cat([piece for block in blocks for piece in block], self.dim)

    @classmethod
    def balanced(cls, global_shape, dim: int, parts: int, rank: int, packed: int = 1) -> "ShardSpec":
        """The balanced split over ``parts`` ranks of ``global_shape[dim]`` (of each of its
        ``packed`` blocks, which must be equal)."""
        global_shape = tuple(int(s) for s in global_shape)
        if packed < 1 or global_shape[dim] % packed:
            raise ValueError(f"ShardSpec: dim {dim} of {global_shape} does not hold {packed} equal packed blocks")
        return cls(dim, global_shape, tuple(shard_sizes(global_shape[dim] // packed, parts)), rank, parts=packed)


def mark_sharded(param: torch.nn.Parameter, spec: ShardSpec) -> None:
    """Attach the layer's `ShardSpec` to its parameter, and the Megatron-style attributes DeepSpeed reads.

    DeepSpeed's gradient-norm code counts a parameter on every model-parallel rank only when
    ``tensor_model_parallel`` is set; that is the only reader of those attributes. bigdense asks
    `shard_spec_of` (or the layers' ``bd_shard_specs()``).
    """
    param.bd_shard_spec = spec
    param.tensor_model_parallel = True
    param.partition_dim = spec.dim
    param.partition_stride = 1


def shard_spec_of(param: torch.Tensor) -> Optional[ShardSpec]:
    """The `ShardSpec` the parameter's layer declared; ``None`` when it is replicated over TP."""
    return getattr(param, "bd_shard_spec", None)


def is_world_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is this rank's shard of a tensor split over every rank of the TP x DP mesh
    (a world-sharded classifier head): data parallelism must leave it alone."""
    spec = shard_spec_of(param)
    return spec is not None and spec.group == "world"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (an FSDP-sharded parameter or gradient:
    a slice along dim 0 of the TP-local tensor), else ``t`` itself. A view: writing it writes ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def is_dtensor(t: torch.Tensor) -> bool:
    # No DTensor exists before its module is imported, and importing it costs every process a
    # second or more (most never meet one): look it up instead.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


@dataclass(frozen=True)
class LogicalBlocks:
    """The separate matrices a weight stacks along ``dim``: block ``j`` is ``global.index_select(dim,
    rows[j])`` (global indices, in the block's own order). A fused qkv weight laid out head by head
    holds q, k and v this way; a packed ``[gate; up]`` holds two contiguous blocks. Read by optimizers
    that treat each block as its own matrix (`bigdense.muon`)."""

    dim: int
    rows: tuple  # one 1-D LongTensor of global indices along ``dim`` per block


def mark_logical_blocks(param: torch.nn.Parameter, dim: int, rows) -> None:
    """Declare that ``param`` stacks separate matrices along ``dim`` (see `LogicalBlocks`); the layer
    that lays the weight out says so, once."""
    param.bd_logical_blocks = LogicalBlocks(dim, tuple(torch.as_tensor(r, dtype=torch.long, device="cpu") for r in rows))


def logical_blocks_of(param: torch.Tensor) -> Optional[LogicalBlocks]:
    """The blocks ``param`` stacks: those its layer declared, else the packed blocks of its `ShardSpec`
    (``parts`` > 1, contiguous along the split dimension), else None (one matrix)."""
    declared = getattr(param, "bd_logical_blocks", None)
    if declared is not None:
        return declared
    spec = shard_spec_of(param)
    if spec is None or spec.parts == 1:
        return None
    return LogicalBlocks(spec.dim, tuple(torch.arange(j * spec.block, (j + 1) * spec.block) for j in range(spec.parts)))
