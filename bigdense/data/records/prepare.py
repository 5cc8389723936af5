"""`prepare_records`: read, check and tokenise the records once (cached, keyed by the files' contents,
the tokenizer and the options), then serve rows as pure functions of the training position.

The build runs under a file lock beside the cache, so the ranks of a machine (and the launchers'
check before the run directory exists, `bigdense.jobs.run`) build it once; a bad record stops every
rank that reads it with the same message, and nothing is written.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ...durable import fsync_tree, hidden_sibling
from ...errors import ConfigError
from ..batches import window
from ..cache import cache_root, publish
from ..tokenizer import BPETokenizer, TokenizerFile, library_version
from .encode import Encoded, RecordTokenizer, encode_examples
from .rows import RowSequence
from .shapes import MESSAGES, PROMPT_COMPLETION, TEXT, Examples, check_records, held_out
from .sources import Problems, RecordFile, read_tables, record_files

log = logging.getLogger("bigdense")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
ARRAYS = ("tokens", "targets", "offsets")
# Where a model directory keeps its chat template (transformers 5 writes it apart from the config).
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
# The options that change what the cache holds (seq_len and pack only change how rows are cut from it).
KEYED_OPTIONS = ("text_field", "prompt_field", "completion_field", "messages_field", "train_on_prompt",
                 "skip_bad_records", "val_fraction", "val_split")


def _digest(path: Path) -> str:
    """A file's (or a saved dataset folder's) contents, hashed once per process for the same name,
    size and modification time: a launch's check before the run directory and its job both key the
    cache, in one process."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return _digest_of(path, tuple((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=64)
def _digest_of(path: Path, files: tuple) -> str:
    import xxhash  # here: bench.gpu's machines import bigdense.data without it

    h = xxhash.xxh3_64()
    for f, _, _ in files:
        h.update(str(f.relative_to(path)).encode() if path.is_dir() else b"")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def record_key(cfg, files: list[RecordFile], val_files: list[RecordFile], tokenizer: Optional[TokenizerFile]) -> str:
    """What a build depends on: the files by name and contents (so the same files agree on every
    machine), the tokenizer (a model's by its files, its chat template included; else the BPE's
    size) and `KEYED_OPTIONS`."""
    doc = {
        "format": FORMAT_VERSION, "tokenizers": library_version(),
        "files": [[f.path.name, f.size, _digest(f.path)] for f in files],
        "val_files": [[f.path.name, f.size, _digest(f.path)] for f in val_files],
        "options": {k: getattr(cfg, k) for k in KEYED_OPTIONS},
    }
    if tokenizer is None:
        doc["vocab_size"] = cfg.vocab_size
    else:
        beside = [tokenizer.path.parent / name for name in CHAT_TEMPLATE_FILES]
        doc["tokenizer"] = [tokenizer.digest(), *(_digest(f) if f.exists() else None for f in beside)]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def find_or_build(cfg, tokenizer_file: Optional[TokenizerFile]) -> tuple[Path, str, bool]:
    """``(cache folder, key, built here)`` for the ``data`` group ``cfg``; a `ConfigError` for a bad
    record (every caller that builds raises it)."""
    files = record_files(cfg.path)
    val_files = record_files(cfg.val_path, "data.val_path") if cfg.val_path else []
    key = record_key(cfg, files, val_files, tokenizer_file)
    path = cache_root(cfg.cache_dir) / "data" / f"records-{key[:20]}"
    with _locked(path):
        if _manifest(path, key) is not None:
            return path, key, False
        _build(cfg, files, val_files, tokenizer_file, path, key)
    return path, key, True


def _manifest(path: Path, key: str) -> Optional[dict]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("key") == key else None


def _build(cfg, files, val_files, tokenizer_file, path: Path, key: str) -> None:
    t0 = time.perf_counter()
    problems = Problems(cfg.skip_bad_records)
    datasets_cache = cache_root(cfg.cache_dir) / "datasets"
    train = check_records(cfg, read_tables(files, datasets_cache, problems), problems)
    val = check_records(cfg, read_tables(files, datasets_cache, problems, "val", cfg.val_split)
                        + read_tables(val_files, datasets_cache, problems), problems)
    named_val = len(val) > 0
    if not named_val:  # a fraction of the records, spread evenly
        picks = held_out(len(train), cfg.val_fraction)
        train, val = train.take([not p for p in picks]), train.take(picks)
    if not len(train) or not len(val):
        raise ConfigError(f"data.path={cfg.path!r}: {len(train)} records to train on and {len(val)} held out; both "
                          "need one at least (give more records, or data.val_path / data.val_split)")
    tokenizer = _tokenizer(cfg, tokenizer_file, train)
    encoded = {s: encode_examples(ex, tokenizer, cfg.train_on_prompt, problems) for s, ex in zip(SPLITS, (train, val))}
    manifest = {
        "key": key, "records": {s: len(e) for s, e in encoded.items()}, "held_out": "named" if named_val else "fraction",
        "shapes": {s: _shape_counts(ex) for s, ex in zip(SPLITS, (train, val))},
        "bad_records": len(problems.messages), "bad_examples": problems.messages[:10],
        "tokens": {s: int(len(e.tokens)) for s, e in encoded.items()},
        "target_tokens": {s: int(e.targets.sum()) for s, e in encoded.items()},
        "vocab_size": tokenizer.tokenizer.vocab_size, "eot": tokenizer.tokenizer.eot,
        "tokenizer": str(tokenizer_file.path) if tokenizer_file else "trained",
        "build_s": round(time.perf_counter() - t0, 2),
    }
    tmp = hidden_sibling(path, "partial")
    tmp.mkdir()
    try:
        tokenizer.tokenizer.save(tmp / "tokenizer.json")
        for split, enc in encoded.items():
            for name in ARRAYS:
                np.save(tmp / f"{split}_{name}.npy", getattr(enc, name))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_tree(tmp)
        publish(tmp, path, lambda p: _manifest(p, key) is not None)  # a complete one of this key is kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer(cfg, tokenizer_file: Optional[TokenizerFile], train: Examples) -> RecordTokenizer:
    """The model's own tokenizer, else a BPE trained on the training records' texts."""
    if tokenizer_file is not None:
        return RecordTokenizer(tokenizer_file.load(), tokenizer_file.path.parent)
    if MESSAGES in train.kinds:
        RecordTokenizer(None, None).chat()  # refused, with the reason
    texts = [v if k == TEXT else v[0] + v[1] for k, v in zip(train.kinds, train.values)]
    return RecordTokenizer(BPETokenizer.train(texts, cfg.vocab_size), None)


def _shape_counts(examples: Examples) -> dict:
    return {k: examples.kinds.count(k) for k in (TEXT, PROMPT_COMPLETION, MESSAGES) if k in examples.kinds}


def _load(path: Path, split: str) -> Encoded:
    return Encoded(*(np.load(path / f"{split}_{name}.npy", mmap_mode="r") for name in ARRAYS))


@dataclass
class RecordData:
    """`bigdense.data.Data`'s interface over records: ``train_batch(step, micro_step)`` is the global
    micro-batch's rows ``[(step - 1) * grad_accum + micro_step] * micro_batch_size * dp_size`` onward
    of the training sequence (`RowSequence`), DP rank ``r`` taking its ``micro_batch_size`` of them,
    so the rows of a step depend on the global batch only, never on the layout."""

    tokenizer: BPETokenizer
    train: RowSequence
    val: RowSequence
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    dp_rank: int
    dp_size: int
    cache_path: Path
    manifest: dict
    built: bool
    load_s: float

    def train_rows(self, step: int, micro_step: int = 0, dp_rank: Optional[int] = None,
                   dp_size: Optional[int] = None) -> range:
        """The indices into the training sequence of this rank's rows of ``(step, micro_step)``."""
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        if step < 1 or not 0 <= micro_step < self.grad_accum:
            raise ValueError(f"step={step} must be >= 1 and micro_step={micro_step} in [0, {self.grad_accum})")
        b = self.micro_batch_size
        first = ((step - 1) * self.grad_accum + micro_step) * b * dp_size + dp_rank * b
        return range(first, first + b)

    def train_batch(self, step: int, micro_step: int = 0, dp_rank: Optional[int] = None,
                    dp_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _stack(self.train, self.train_rows(step, micro_step, dp_rank, dp_size))

    def val_batches(self, n: int, dp_rank: Optional[int] = None,
                    dp_size: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` held-out batches: the held-out rows in file order (cycled when there are fewer)."""
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        b = self.micro_batch_size
        return [_stack(self.val, range(i * b * dp_size + dp_rank * b, i * b * dp_size + (dp_rank + 1) * b))
                for i in range(n)]

    def batch_rows(self, dp_rank: Optional[int] = None, dp_size: Optional[int] = None) -> tuple[int, int]:
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        return dp_rank * self.micro_batch_size, dp_size * self.micro_batch_size

    def describe(self) -> str:
        m, use = self.manifest, self.train.usable
        rows = self.train.rows_per_epoch(0)
        how = f"built in {m['build_s']:.1f} s" if self.built else f"loaded in {self.load_s:.2f} s"
        bad = f", {m['bad_records']} bad records skipped" if m["bad_records"] else ""
        return (f"records: {m['records']['train']:,} to train on, {m['records']['val']:,} held out "
                f"({m['held_out']}; shapes {m['shapes']['train']}){bad}; {use.cut} cut to data.seq_len + 1 = "
                f"{window(self.seq_len)} tokens, {use.dropped} dropped with no target; "
                f"{'packed into' if self.train.pack else 'one per row,'} {rows:,} rows an epoch, "
                f"{use.target_tokens / max(rows * self.seq_len, 1):.1%} of their tokens targets; "
                f"vocab {self.tokenizer.vocab_size}; cache {self.cache_path}, {how}")

    def _dp(self, dp_rank, dp_size):
        return (self.dp_rank if dp_rank is None else dp_rank), (self.dp_size if dp_size is None else dp_size)


def _stack(rows: RowSequence, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [rows.row(g) for g in indices]
    return (torch.from_numpy(np.stack([x for x, _ in pairs])), torch.from_numpy(np.stack([y for _, y in pairs])))


def prepare_records(cfg, ctx, *, seed: int, tokenizer: Optional[TokenizerFile]) -> RecordData:
    """The records of the ``data`` group ``cfg`` for this rank of ``ctx``; every rank calls it (each
    finds the cache, or builds it under the lock, or raises the same `ConfigError`)."""
    t0 = time.perf_counter()
    path, key, built = find_or_build(cfg, tokenizer)
    manifest = _manifest(path, key)
    tok = BPETokenizer.load(path / "tokenizer.json", manifest["vocab_size"], manifest["eot"])
    train = RowSequence(_load(path, "train"), cfg.seq_len, cfg.pack, tok.eot_id, seed=seed)
    val = RowSequence(_load(path, "val"), cfg.seq_len, cfg.pack, tok.eot_id, seed=None)
    for split, rows in (("training", train), ("held-out", val)):
        if not len(rows.usable.keep):
            raise ConfigError(f"data.path={cfg.path!r}: no {split} example has a target within data.seq_len + 1 = "
                              f"{window(cfg.seq_len)} tokens ({rows.usable.dropped} dropped): raise data.seq_len, "
                              "or check the masking with python -m bigdense.data show")
    if manifest["bad_records"]:
        log.warning("data: %d bad records skipped (data.skip_bad_records=true), the first: %s",
                    manifest["bad_records"], "; ".join(manifest["bad_examples"][:3]))
    return RecordData(tok, train, val, cfg.seq_len, cfg.micro_batch_size, cfg.grad_accum, ctx.dp_rank, ctx.dp_size,
                      path, manifest, built, time.perf_counter() - t0)
