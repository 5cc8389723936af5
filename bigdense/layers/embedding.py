"""An embedding table whose rows (the vocabulary) are sharded over TP."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..host_checks import checks_enabled
from ..parallel.regions import reduce_from_tp, reduce_scatter_to_sequence
from ..parallel.sharding import shard_range, shard_sizes
from ..errors import check_positive_int
from .base import TensorParallelModule, refuse_options
from .init import InitSpec, resolve_init


class VocabParallelEmbedding(TensorParallelModule):
    """``nn.Embedding`` with its ``num_embeddings`` rows split over TP (balanced; uneven allowed).

    Per rank: ``weight`` (rows_local, embedding_dim) holds rows ``[row_start, row_start + rows_local)``,
    declared sharded on dim 0; ``rows_local`` may be 0 when ``num_embeddings < tp``.
    Input: integer ids (*), the same on every TP rank. Output: (*, embedding_dim), the same on
    every TP rank. Each rank looks up the ids it owns, writes zeros for the others, and the
    partial results are summed over TP.
    Collectives: forward all-reduce (sum) of the (*, embedding_dim) output; backward none.
    ``sequence_parallel=True``: ids (*, S), output (*, S_local, embedding_dim), this rank's
    balanced share of the sequence: forward reduce-scatter instead of the all-reduce, backward
    all-gather of the output gradient.

    An id outside ``[0, num_embeddings)`` raises ValueError naming the layer and the id, on every
    rank (the ids are replicated, so each rank checks them itself: no collective, no hang); this
    check reads one min/max back to the host per call, so it runs only while `bd.set_checks` is
    on. With checks off nothing is read back: at tp > 1 an id out of range belongs to no rank and
    its output row is NaN (so the loss is NaN and the training loop skips the step); at tp=1
    ``F.embedding`` raises (CPU) or fails a device-side assert (CUDA).
    ``padding_idx`` behaves as in nn.Embedding: that row starts at zero and never gets a gradient.
    ``init`` defaults to nn.Embedding's N(0, 1) ("normal"); the full table is the same at any TP size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: Optional[int] = None,
        sequence_parallel: bool = False,
        init: InitSpec = "normal",
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            check_positive_int(f"VocabParallelEmbedding: {name}", value)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx must be in [-{num_embeddings}, {num_embeddings}), "
                    f"got {padding_idx}"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = bool(sequence_parallel)
        self._setup_tp(tp_group)
        self.init = resolve_init(init, f"VocabParallelEmbedding({num_embeddings}, {embedding_dim})")
        self.partition_sizes = shard_sizes(num_embeddings, self.tp_size)
        self.row_start, row_stop = shard_range(num_embeddings, self.tp_size, self.tp_rank)
        self.rows_local = row_stop - self.row_start
        self.weight = nn.Parameter(torch.empty(self.rows_local, embedding_dim, device=device, dtype=dtype))
        self._declare_shard("weight", (num_embeddings, embedding_dim), 0)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    @property
    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None or not 0 <= self.padding_idx - self.row_start < self.rows_local:
            return None
        return self.padding_idx - self.row_start

    def reset_parameters(self) -> None:
        """This rank's rows of the TP-invariant global table; the padding row zeroed."""
        with torch.no_grad():
            global_shape = (self.num_embeddings, self.embedding_dim)
            self.init.init_(self.weight, global_shape, (self.row_start, 0), self._weight_seed)
            if self._local_padding_idx is not None:
                self.weight[self._local_padding_idx].zero_()

    def _describe_shape(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return (
            f"{self._describe_shape()}{pad}, rows on this rank={self.rows_local} (from {self.row_start}), "
            f"tp={self.tp_size}, init={self.init.name}{sp}"
        )

    def _check_ids(self, ids: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{self._where()}: expected a tensor of ids, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{self._where()}: ids must be an integer tensor, got dtype {ids.dtype}")
        if ids.device != self.weight.device:
            raise ValueError(f"{self._where()}: ids are on {ids.device} but the table is on {self.weight.device}")
        if ids.numel() == 0 or not checks_enabled():
            return
        lo, hi = (int(v) for v in torch.stack(list(torch.aminmax(ids))).tolist())
        if lo < 0 or hi >= self.num_embeddings:
            bad = ids[(ids < 0) | (ids >= self.num_embeddings)]
            raise ValueError(
                f"{self._where()}: id {int(bad[0])} is outside [0, {self.num_embeddings}) "
                f"({bad.numel()} bad id(s) in an input of shape {tuple(ids.shape)})"
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        if self.sequence_parallel and ids.dim() < 1:
            raise ValueError(f"{self._where()}: sequence_parallel=True expects ids (*, S), got a scalar")
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        if self.rows_local == 0:
            # This rank owns no row: its partial sum is zero. Adding the (empty, so zero) sum of the
            # weight keeps the output in the autograd graph, as it is on the other ranks.
            partial = self.weight.new_zeros(tuple(ids.shape) + (self.embedding_dim,)) + self.weight.sum()
        else:
            local = ids - self.row_start
            elsewhere = (local < 0) | (local >= self.rows_local)
            # Row 0 stands in for ids another rank owns; zeroing its output also zeroes its gradient.
            partial = F.embedding(local.masked_fill(elsewhere, 0), self.weight, self._local_padding_idx)
            partial = partial.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if not checks_enabled():  # an id owned by no rank (out of range) is marked on the device
            unowned = (ids < 0) | (ids >= self.num_embeddings)
            partial = partial.masked_fill(unowned.unsqueeze(-1), float("nan"))
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.tp_group)
        return reduce_from_tp(partial, self.tp_group)

    # ---- the plain twin (`DenseTwin`): an nn.Embedding ----
    _dense_kind = nn.Embedding

    def _dense_twin(self) -> nn.Embedding:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device="meta",
                            dtype=self.weight.dtype)

    @classmethod
    def _empty_from_dense(cls, embedding: nn.Embedding, **options) -> "VocabParallelEmbedding":
        refuse_options(cls, options, ("padding_idx", "device", "dtype", "init"), "nn.Embedding")
        unsupported = {
            "max_norm": embedding.max_norm is not None,
            "scale_grad_by_freq": embedding.scale_grad_by_freq,
            "sparse": embedding.sparse,
        }
        if any(unsupported.values()):
            raise ValueError(
                f"{cls.__name__}.from_dense: {[k for k, v in unsupported.items() if v]} are not supported"
            )
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx,
            device="meta", dtype=embedding.weight.dtype, **options,
        )
        return layer.to_empty(device=embedding.weight.device)
