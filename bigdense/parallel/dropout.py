"""Dropout masks that do not depend on the layout: `tp_dropout`, and `batch_slice` for the rows
of a global batch.

Element ``(row, col)`` of a mask is kept when its hash word (`bigdense.parallel.random`'s counter
hash, keyed by a tensor drawn from torch's default generator of the activation's device -- the CPU's
for CPU tensors -- and never read on the host) is below
a threshold: a pure function of (key, global row, global column), so a rank applies exactly its
slice of the mask the unsharded model draws, at any TP and DP size, in a fixed number of tensor
ops, and torch.compile traces it without a break.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..kernels import counter_hash
from ..kernels.counter_hash import kept
from .random import GOLDEN, M1, index_words, words_of


def draw_dropout_key(device="cpu") -> torch.Tensor:
    """Two random 32-bit words, as an int32 tensor of shape (2,) on ``device``: the key of one
    dropout mask, drawn from torch's default generator of that device (the CPU's for a CPU
    tensor). Never read on the host (no sync; traceable by torch.compile). On an accelerator the
    draw is a device op: nothing crosses from the host, so a CUDA graph can capture it (CUDA's
    generator is graph-safe: each replay draws new keys) and activation checkpointing, which
    restores the device's generator too, redraws the same key."""
    return torch.randint(-(2**31), 2**31, (2,), dtype=torch.int32, device=device)


_batch_slice: tuple[int, int] | None = None


@contextlib.contextmanager
def batch_slice(start: int, total: int):
    """Declare that dim 0 of every activation is rows ``[start, start + B)`` of a global batch of
    ``total`` rows (data parallelism, micro-batching). `tp_dropout` then draws the rows of the
    global batch's mask, so masks do not depend on the data-parallel size either."""
    global _batch_slice
    previous, _batch_slice = _batch_slice, (int(start), int(total))
    try:
        yield
    finally:
        _batch_slice = previous


def current_batch_slice() -> tuple[int, int] | None:
    """``(start, total)`` of the innermost `batch_slice`, or None outside one (activation
    checkpointing re-enters it for the recompute, which runs later, during backward)."""
    return _batch_slice


def keep_mask(key: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], p: float, device) -> torch.Tensor:
    """The keep-mask (bool, (n, m)) of rows ``[r0, r0 + n)`` and columns ``[c0, c0 + m)`` of the
    global mask for ``key`` (`draw_dropout_key`) and drop probability ``p``; ``rows = (r0, n)``,
    ``cols = (c0, m)``. A pure function of (key, global row, global column): any slice of it
    equals the same slice of the whole mask.

    Word ``(i, j)`` is ``fmix32((i * A ^ key0) ^ (j * B + key1))``: the row and column words are
    cheap vectors and the one full-size mix does the avalanche. About 20 ops whatever the size,
    14 of them full-size (one fused kernel under torch.compile)."""
    return _keep(key, index_words(rows[0], rows[1], M1, device), cols, p, device)


def _keep(key: torch.Tensor, row_words: torch.Tensor, cols: tuple[int, int], p: float, device) -> torch.Tensor:
    """`keep_mask` of the rows whose index words are ``row_words``."""
    return kept(*_words(key, row_words, cols, device), _threshold(p))


def _words(key: torch.Tensor, row_words: torch.Tensor, cols: tuple[int, int], device):
    """The keyed words of the mask's rows and columns: element (i, j)'s hash is
    ``fmix32(row_word[i] ^ col_word[j])``."""
    key = key.to(device, non_blocking=True)
    return row_words ^ key[0], index_words(cols[0], cols[1], GOLDEN, device) + key[1]


def _threshold(p: float) -> int:
    """The threshold a word is kept below: ``round((1 - p) * 2^32) - 2^31``, compared with the
    words as the int32 tensors they are (signed). That keeps a word when, with its top bit
    flipped and read as unsigned, it is below ``(1 - p) * 2^32`` -- not the word itself read as
    unsigned; the hash is uniform over the 2^32 words, so exactly ``round((1 - p) * 2^32)`` of
    them are kept either way. Above 2^31 - 1 (p at most 2^-33) every word is kept."""
    return int(round((1.0 - p) * 2**32)) - 2**31


def _apply(x: torch.Tensor, key: torch.Tensor, row_words: torch.Tensor, cols: tuple[int, int], p: float):
    """``x`` times its keep-mask (rows ``row_words``, columns ``cols``) times 1 / (1 - p). Eager
    on CUDA: one Triton pass each way that never stores the mask (`kernels.triton_dropout`); traced
    by torch.compile, the torch ops, which inductor fuses into one pass each way."""
    keep_scale = counter_hash.keep_scale
    if not torch.compiler.is_compiling() and counter_hash.dropout_kernels(x.device) == "triton":
        from ..kernels.triton_dropout import keep_scale
    row_word, col_word = _words(key, row_words, cols, x.device)
    out = keep_scale(x.reshape(row_word.numel(), col_word.numel()), row_word, col_word, _threshold(p), 1.0 / (1.0 - p))
    return out.view(x.shape)


def tp_dropout(
    x: torch.Tensor,
    p: float,
    training: bool = True,
    *,
    shard_dim: int | None = None,
    global_size: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Dropout whose mask does not depend on the TP size.

    Each call draws one key from torch's default generator of ``x``'s device (`draw_dropout_key`;
    a tensor, never read on the host), so (a) activation checkpointing, which restores that
    generator before recomputing, redraws the same mask, and (b) every TP rank draws the same key
    as long as all ranks were seeded alike. The mask is a pure function of (key, global element
    index) (`keep_mask`):

    * replicated region (``shard_dim=None``): ``x`` is the whole tensor; every TP rank applies the
      same mask.
    * sharded region: ``x`` is this rank's slice ``[offset : offset + x.shape[shard_dim]]`` of a
      dimension of length ``global_size``; the rank applies exactly that slice of the mask the
      unsharded model would draw. A shard of the second-to-last dimension (sequence parallelism's
      split of ``(*, seq, hidden)``) applies exactly its rows of the replicated region's mask, so
      a model draws the same masks with and without sequence parallelism.

    Inside `batch_slice`, dim 0 is further read as a slice of the global batch. A fixed number of
    tensor ops whatever the size of ``x``; under ``torch.compile`` it traces without a break.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"tp_dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if x.dim() == 0:
        return tp_dropout(x.reshape(1), p, training).reshape(())
    # An empty shard (a sequence share of 0 rows when S < tp) takes the same path as the others:
    # it draws the key, so every rank's generator advances alike, and multiplies by its (empty)
    # mask, so its graph saves the same tensors; activation checkpointing then recomputes at the
    # same point of the backward on every rank, and the recomputed collectives stay in step.
    key = draw_dropout_key(x.device)
    shape = list(x.shape)
    if shard_dim is None:
        rows, cols, col_offset = math.prod(shape[:-1]), shape[-1], 0
    else:
        shard_dim %= x.dim()
        if global_size is None:
            raise ValueError("tp_dropout: a sharded region needs global_size")
        if not 0 <= offset <= offset + shape[shard_dim] <= global_size:
            raise ValueError(
                f"tp_dropout: the shard [{offset}, {offset + shape[shard_dim]}) of dim {shard_dim} does not fit "
                f"in global_size={global_size}"
            )
        if shard_dim == 0 and _batch_slice is not None:
            raise ValueError("tp_dropout: dim 0 is the data-parallel batch inside batch_slice; it cannot be TP-sharded")
        if shard_dim == x.dim() - 2:
            return _apply(x, key, _sequence_share_rows(shape, global_size, offset, x.device), (0, shape[-1]), p)
        # Global tensor viewed as (outer, global_size * inner): a shard is then the same
        # contiguous column range in every row.
        inner = math.prod(shape[shard_dim + 1 :])
        rows, cols, col_offset = math.prod(shape[:shard_dim]), math.prod(shape[shard_dim:]), offset * inner
    row_offset = 0
    if _batch_slice is not None:  # rows per batch element: every dim between the batch and the columns
        row_offset = _batch_slice[0] * (math.prod(shape[1:-1]) if shard_dim is None else math.prod(shape[1:shard_dim]))
    return _apply(x, key, index_words(row_offset, rows, M1, x.device), (col_offset, cols), p)


def _sequence_share_rows(shape, global_size: int, offset: int, device) -> torch.Tensor:
    """The row words of a share ``[offset, offset + S_local)`` of dim -2 of ``(*, S, d)``: exactly
    those rows of the replicated region's mask (whose rows are the flattened leading dims), built
    from one tensor of row indices, so the op count does not grow with the leading dims."""
    slabs = math.prod(shape[:-2])
    row0 = _batch_slice[0] * (slabs // shape[0]) * global_size if _batch_slice is not None else 0
    index = (
        torch.arange(slabs, dtype=torch.int64, device=device).unsqueeze(1) * global_size
        + torch.arange(offset, offset + shape[-2], dtype=torch.int64, device=device)
        + row0
    ).reshape(-1)
    wide = row0 + slabs * global_size > 2**31  # the word rule the replicated region's rows use
    return words_of(index, M1, wide)
