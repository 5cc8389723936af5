"""Training text: a local corpus, a locally trained byte-level BPE, cached token arrays, and batches
that are pure functions of the training step.

    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    x, y = data.train_batch(step, micro_step)      # (micro_batch_size, seq_len) int64 each
    evals = data.val_batches(cfg.trainer.eval_batches)

``data.source=records`` (`bigdense.data.records`) gives a `RecordData` with the same interface: rows
of JSON Lines, Parquet, CSV, Arrow or saved-dataset records, ``y`` -100 where a token is not a target.
"""
from .batches import BatchSampler, eval_batches
from .cache import cache_root
from .corpus import list_files, read_corpus, split_files
from .file_classes import FileWindows
from .prepare import Data, prepare_data
from .records import RecordData
from .tokenizer import EOT, BPETokenizer, TokenizerFile, token_dtype

__all__ = [
    "prepare_data", "Data", "RecordData", "BPETokenizer", "TokenizerFile", "BatchSampler", "eval_batches", "list_files", "read_corpus",
    "split_files", "cache_root", "token_dtype", "EOT", "FileWindows",
]
