"""Rows of ``seq_len`` inputs and targets from tokenised examples, as pure functions of the row's
index: packed (``data.pack=true``: whole examples joined until the next one does not fit, the rest
padded) or one example per row, padded.

Each row is ``seq_len + 1`` tokens, ``x = row[:-1]``, ``y = row[1:]`` with ``-100`` wherever the
token is not a target: padding, non-target tokens, and each example's first token, so no target
crosses from one example into the next. An example longer than a row is cut to ``seq_len + 1``
tokens (counted); one left with no target is dropped (counted). Examples in a packed row attend to
the earlier ones in the row (no per-example attention mask, as in TRL's and torchtune's packing
without one).

Training rows come epoch after epoch, each epoch the kept examples in an order drawn from
``(seed, epoch)``; held-out rows keep the file order. Row ``g`` of the sequence depends on nothing
else, so a resumed run continues at the exact next example at any layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..batches import window
from .encode import Encoded

IGNORE_INDEX = -100  # the engines' masked target (`bigdense.train.engines.base.IGNORE_INDEX`)


@dataclass(frozen=True)
class Usable:
    """Which examples a row of ``seq_len + 1`` tokens keeps, and how many of each kind there are."""

    keep: np.ndarray  # indices of examples with a target within their first seq_len + 1 tokens
    lengths: np.ndarray  # every example's length after the cut
    cut: int  # kept examples longer than a row
    dropped: int  # examples with no target left (after the cut)
    target_tokens: int  # the kept examples' targets after the cut: an epoch's targets

    @classmethod
    def of(cls, enc: Encoded, seq_len: int) -> "Usable":
        cap = window(seq_len)
        lengths = np.minimum(enc.lengths, cap)
        counted = np.concatenate([[0], np.cumsum(enc.targets, dtype=np.int64)])
        targets = counted[enc.offsets[:-1] + lengths] - counted[enc.offsets[:-1]]
        keep = np.flatnonzero(targets > 0)
        return cls(keep, lengths, int((enc.lengths[keep] > cap).sum()), int((targets == 0).sum()),
                   int(targets.sum()))


def row_starts(lengths: np.ndarray, cap: int, pack: bool) -> np.ndarray:
    """Boundaries of rows over examples of ``lengths`` in order: row ``r`` holds examples
    ``[starts[r], starts[r + 1])``; packed greedily, else one each."""
    if not pack:
        return np.arange(len(lengths) + 1, dtype=np.int64)
    starts, fill = [0], 0
    for j, n in enumerate(lengths.tolist()):
        if fill + n > cap:
            starts.append(j)
            fill = 0
        fill += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


class RowSequence:
    """The rows of one split: ``row(g)`` for any ``g >= 0`` (training: across epochs; held out: the
    file order, cycled)."""

    def __init__(self, enc: Encoded, seq_len: int, pack: bool, pad_id: int, seed: Optional[int]):
        self.enc, self.seq_len, self.pack, self.pad_id, self.seed = enc, seq_len, pack, pad_id, seed
        self.usable = Usable.of(enc, seq_len)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._first_rows = [0]  # row index at which each epoch starts, as far as known

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """``(order, starts)``: epoch ``e``'s example order and row boundaries."""
        if e not in self._epochs:
            keep = self.usable.keep
            order = keep if self.seed is None else np.random.default_rng([self.seed, e]).permutation(keep)
            if len(self._epochs) > 4:  # a long run moves forward: keep a few recent epochs only
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = order, row_starts(self.usable.lengths[order], window(self.seq_len), self.pack)
        return self._epochs[e]

    def rows_per_epoch(self, e: int) -> int:
        return len(self.epoch(e)[1]) - 1

    def locate(self, g: int) -> tuple[int, int]:
        """``(epoch, row within it)`` of row ``g``."""
        if self.seed is None:  # held out: one fixed order, cycled
            return 0, g % self.rows_per_epoch(0)
        if not self.pack:  # one example per row: every epoch has as many rows
            return divmod(g, len(self.usable.keep))
        while self._first_rows[-1] <= g:
            self._first_rows.append(self._first_rows[-1] + self.rows_per_epoch(len(self._first_rows) - 1))
        e = int(np.searchsorted(self._first_rows, g, side="right")) - 1
        return e, g - self._first_rows[e]

    def examples(self, g: int) -> np.ndarray:
        """The example indices of row ``g``."""
        e, r = self.locate(g)
        order, starts = self.epoch(e)
        return order[starts[r]:starts[r + 1]]

    def row(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` int64 of length ``seq_len`` for row ``g``."""
        cap = window(self.seq_len)
        tokens = np.full(cap, self.pad_id, dtype=np.int64)
        targets = np.zeros(cap, dtype=bool)
        at = 0
        for i in self.examples(g).tolist():
            start, n = int(self.enc.offsets[i]), int(self.usable.lengths[i])
            tokens[at:at + n] = self.enc.tokens[start:start + n]
            targets[at:at + n] = self.enc.targets[start:start + n]
            at += n
        return tokens[:-1], np.where(targets[1:], tokens[1:], IGNORE_INDEX)
