"""Batches of token windows, as pure functions of their position in training.

The global batch of one micro-step is ``micro_batch_size * dp_size`` windows; data-parallel rank
``r`` takes rows ``[r * micro_batch_size, (r + 1) * micro_batch_size)``. So the ranks of one TP
group get identical batches, and the rows of all DP ranks together do not depend on ``dp_size``:
a tp=2 x dp=2 run sees the same data as a tp=1 run with the same global batch. The sampler never
touches torch's default generator (dropout draws from it).
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    w = torch.from_numpy(rows)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _check_rank(dp_rank: int, dp_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")


def window(seq_len: int) -> int:
    """Tokens of one window: ``seq_len`` inputs and the target after the last."""
    return seq_len + 1


def _check_length(tokens: np.ndarray, seq_len: int, split: str) -> None:
    if len(tokens) < window(seq_len):
        raise ConfigError(
            f"the {split} split has {len(tokens)} tokens, fewer than data.seq_len + 1 = {window(seq_len)}: "
            "lower data.seq_len, or give more text (data.max_corpus_mb, data.path, data.val_fraction)"
        )


def balance_splits(train: np.ndarray, val: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` holding one window each at least: a split shorter than that takes what it
    lacks from the other, the held-out split from the end of the training split, the training split
    from the start of the held-out one (for one file, the text beside the cut), so too few files, or
    a file's held-out tail shorter than a window, still give both. Nothing is in both. The longer
    split stays a view (a memory map stays one); the short one becomes a small copy. Raises
    `ConfigError` when the two together hold fewer than two windows."""
    need, total = window(seq_len), len(train) + len(val)
    if total < 2 * need:
        raise ConfigError(
            f"the corpus holds {total:,} tokens ({len(train):,} to train on, {len(val):,} held out), fewer than two "
            f"windows of data.seq_len + 1 = {need} (one to train on, one held out): lower data.seq_len, or give "
            "more text (data.path, data.max_corpus_mb)"
        )
    if len(val) < need:
        cut = len(train) - (need - len(val))
        return train[:cut], np.concatenate([train[cut:], val])
    if len(train) < need:
        cut = need - len(train)
        return np.concatenate([train, val[:cut]]), val[cut:]
    return train, val


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from ``tokens`` (any 1-D integer array, e.g. a memmap).

    `batch` is a pure function of ``(seed, step, micro_step)`` and the slice arguments: resuming at a
    step needs no sampler state.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, seed: int):
        _check_length(tokens, seq_len, "training")
        self.tokens, self.seq_len, self.micro_batch_size = tokens, seq_len, micro_batch_size
        self.seed = int(seed) % (1 << 64)  # numpy seeds are non-negative

    def global_starts(self, step: int, micro_step: int, dp_size: int) -> np.ndarray:
        """Start offsets of the whole micro-step's ``micro_batch_size * dp_size`` windows."""
        if step < 0 or micro_step < 0:
            raise ValueError(f"step={step} and micro_step={micro_step} must be >= 0")
        rng = np.random.default_rng([self.seed, step, micro_step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.micro_batch_size * dp_size)

    def batch(self, step: int, micro_step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64, shape ``(micro_batch_size, seq_len)``, ``y[:, t] == x[:, t + 1]`` and
        ``y[:, -1]`` the token after the window."""
        _check_rank(dp_rank, dp_size)
        b = self.micro_batch_size
        return _windows(self.tokens, self.global_starts(step, micro_step, dp_size)[dp_rank * b:(dp_rank + 1) * b],
                        self.seq_len)


def eval_batches(tokens: np.ndarray, n: int, seq_len: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` held-out batches, each ``(x, y)`` of shape ``(micro_batch_size, seq_len)``: the same on
    every call. The ``n * micro_batch_size * dp_size`` windows do not overlap and are spread evenly
    over the whole split (windows repeat only when the split holds fewer than that many)."""
    _check_length(tokens, seq_len, "validation")
    _check_rank(dp_rank, dp_size)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    total = n * micro_batch_size * dp_size
    n_windows = (len(tokens) - 1) // seq_len
    starts = (np.arange(total, dtype=np.int64) * n_windows // max(total, 1)) * seq_len
    per_batch = micro_batch_size * dp_size
    out = []
    for i in range(n):
        rows = starts[i * per_batch + dp_rank * micro_batch_size:][:micro_batch_size]
        out.append(_windows(tokens, rows, seq_len))
    return out
