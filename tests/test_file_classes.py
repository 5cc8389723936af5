"""FileWindows: the many-class task built from the corpus (which document a window comes from)."""
import numpy as np
import pytest
import torch

from bigdense.config import ConfigError
from bigdense.data import FileWindows

EOT, L = 0, 8


def _corpus():
    """Documents of lengths 40, 5 (too short: not a class), 100, 16 (exactly two windows); token
    values encode (document, position) so every window tells where it came from."""
    docs, lengths = [], (40, 5, 100, 16)
    for d, n in enumerate(lengths):
        docs += [1000 * (d + 1) + np.arange(n), np.array([EOT])]
    return np.concatenate(docs).astype(np.int64), lengths


def _doc_and_pos(window):
    return window // 1000 - 1, window % 1000


def test_classes_windows_and_held_out_tails():
    tokens, lengths = _corpus()
    task = FileWindows.from_tokens(tokens, EOT, seq_len=L, micro_batch_size=64, seed=3)
    docs = [0, 2, 3]  # the 5-token document cannot give a training and a held-out window
    assert task.num_classes == 3
    held_out_from = {c: lengths[d] - max(int(np.ceil(lengths[d] * 0.1)), L) for c, d in enumerate(docs)}
    x, y = task.train_batch(step=1, micro_step=0, dp_rank=0, dp_size=1)
    assert x.shape == (64, L) and y.shape == (64,) and x.dtype == y.dtype == torch.int64
    seen = set()
    for row, c in zip(x.numpy(), y.tolist()):
        doc, pos = _doc_and_pos(row)
        assert (doc == docs[c]).all() and (np.diff(pos) == 1).all(), "a window is consecutive tokens of its class"
        assert pos[-1] < held_out_from[c], "training windows stay out of the held-out tail"
        seen.add(c)
    assert seen == {0, 1, 2}
    for xv, yv in task.val_batches(3, 0, 1):
        for row, c in zip(xv.numpy(), yv.tolist()):
            doc, pos = _doc_and_pos(row)
            assert (doc == docs[c]).all() and pos[0] >= held_out_from[c] and pos[-1] < lengths[docs[c]]


def test_batches_are_pure_functions_and_data_parallel_slices():
    tokens, _ = _corpus()
    task = FileWindows.from_tokens(tokens, EOT, seq_len=L, micro_batch_size=4, seed=5)
    x, y = task.train_batch(7, 1, 0, 1)
    x2, y2 = task.train_batch(7, 1, 0, 1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, task.train_batch(8, 1, 0, 1)[0])
    # dp=2 with micro-batch 2: the two ranks' rows are the dp=1 run's global batch of 4.
    half = FileWindows.from_tokens(tokens, EOT, seq_len=L, micro_batch_size=2, seed=5)
    parts = [half.train_batch(7, 1, r, 2) for r in range(2)]
    big = FileWindows.from_tokens(tokens, EOT, seq_len=L, micro_batch_size=4, seed=5).train_batch(7, 1, 0, 1)
    assert torch.equal(torch.cat([p[0] for p in parts]), big[0]) and torch.equal(torch.cat([p[1] for p in parts]), big[1])
    v1 = [b for r in range(2) for b in half.val_batches(2, r, 2)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, [b for r in range(2) for b in half.val_batches(2, r, 2)]))


def test_too_little_text_is_a_config_error():
    tokens = np.array([5, 6, 7, EOT, 8, 9, EOT])
    with pytest.raises(ConfigError, match="lower data.seq_len"):
        FileWindows.from_tokens(tokens, EOT, seq_len=L)
