"""A many-class task built from the corpus: which file a window of tokens comes from.

Every training document of the prepared corpus (one file of this Python's standard library, say)
is a class. Its tokens are split in two: the last ``val_share`` of them (at least one window) are
held out, the rest are for training, so held-out windows come from the same files but were never
seen. A document too short for one window on each side is not a class. Like `BatchSampler`, every
batch is a pure function of (seed, step, micro-step) and the DP slice, and never touches torch's
default generator.

    task = FileWindows.from_tokens(data.train_tokens, data.tokenizer.eot_id, seq_len=128)
    x, y = task.train_batch(step, 0, dp_rank, dp_size)    # (B, 128) token ids, (B,) class ids
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError

VAL_WINDOWS_PER_CLASS = 2  # held-out windows per class, evenly spaced over its held-out tokens


@dataclass
class FileWindows:
    """Classes are documents; ``train_start/train_len`` and ``val_start/val_len`` (one entry per
    class) locate each class's two parts in ``tokens``."""

    tokens: np.ndarray
    train_start: np.ndarray
    train_len: np.ndarray
    val_start: np.ndarray
    val_len: np.ndarray
    seq_len: int
    micro_batch_size: int
    seed: int

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, eot_id: int, *, seq_len: int, micro_batch_size: int = 16,
                    seed: int = 0, val_share: float = 0.1) -> "FileWindows":
        ends = np.flatnonzero(np.asarray(tokens) == eot_id)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        lengths = (ends - starts).astype(np.int64)
        val_len = np.maximum(np.ceil(lengths * val_share).astype(np.int64), seq_len)
        keep = lengths - val_len >= seq_len
        if keep.sum() < 2:
            raise ConfigError(
                f"the corpus has {int(keep.sum())} documents of at least {2 * seq_len} tokens; the file classification "
                "task needs two or more: lower data.seq_len or give more text (data.max_corpus_mb)"
            )
        starts, lengths, val_len = starts[keep], lengths[keep], val_len[keep]
        return cls(tokens, starts, lengths - val_len, starts + lengths - val_len, val_len, int(seq_len),
                   int(micro_batch_size), int(seed) % (1 << 64))

    @property
    def num_classes(self) -> int:
        return len(self.train_start)

    def describe(self) -> str:
        return (f"{self.num_classes} classes (files), {int(self.train_len.sum()):,} training and "
                f"{int(self.val_len.sum()):,} held-out tokens; windows of {self.seq_len} tokens")

    def _windows(self, starts: np.ndarray) -> torch.Tensor:
        rows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len)], dtype=np.int64)
        return torch.from_numpy(rows)

    def train_batch(self, step: int, micro_step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[dp_rank * B, (dp_rank + 1) * B)`` of the global micro-batch of ``(step, micro_step)``:
        each row a uniformly drawn class and a uniformly drawn window of its training part."""
        rng = np.random.default_rng([self.seed, step, micro_step])
        total = self.micro_batch_size * dp_size
        classes = rng.integers(0, self.num_classes, size=total)
        offsets = (rng.random(total) * (self.train_len[classes] - self.seq_len + 1)).astype(np.int64)
        mine = slice(dp_rank * self.micro_batch_size, (dp_rank + 1) * self.micro_batch_size)
        return self._windows(self.train_start[classes][mine] + offsets[mine]), torch.from_numpy(classes[mine])

    def val_batches(self, n: int, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` held-out batches shaped like `train_batch`'s, the same at every call: the held-out
        windows (`VAL_WINDOWS_PER_CLASS` per class) in a fixed shuffled order, repeating if needed."""
        per_class = VAL_WINDOWS_PER_CLASS
        classes = np.repeat(np.arange(self.num_classes), per_class)
        j = np.tile(np.arange(per_class), self.num_classes)
        starts = self.val_start[classes] + j * (self.val_len[classes] - self.seq_len) // max(per_class - 1, 1)
        order = np.random.default_rng(0).permutation(len(classes))
        total = self.micro_batch_size * dp_size
        out = []
        for i in range(n):
            pick = order[np.arange(i * total, (i + 1) * total) % len(order)]
            mine = pick[dp_rank * self.micro_batch_size:(dp_rank + 1) * self.micro_batch_size]
            out.append((self._windows(starts[mine]), torch.from_numpy(classes[mine])))
        return out
