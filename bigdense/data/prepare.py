"""`prepare_data`: one rank builds the cache when it is missing, every rank then memory-maps it."""
from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError, check_choice, check_positive
from . import cache
from .batches import BatchSampler, _check_length, balance_splits, eval_batches, window
from .corpus import RECORDS, SOURCES, CorpusFile, list_files, source_name, source_root
from .records import RecordData, find_or_build, prepare_records
from .records.shapes import named_shape
from .records.sources import record_files
from .tokenizer import MIN_VOCAB, BPETokenizer, TokenizerFile

log = logging.getLogger("bigdense")


@dataclass
class Data:
    """The prepared corpus of one run.

    ``train_tokens``/``val_tokens`` are read-only 1-D memory maps (uint16, or uint32 above 65536
    entries), documents separated by ``tokenizer.eot_id``; no token is in both, and no file
    contributes to both unless the split had to go within one (a single file, or a split too short
    for a window: `balance_splits`, whose short split is a small copy in memory).
    """

    tokenizer: BPETokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    seq_len: int
    micro_batch_size: int
    seed: int
    dp_rank: int
    dp_size: int
    cache_path: Path
    manifest: dict
    built: bool  # this process built the cache (else it was found)
    load_s: float

    def __post_init__(self):
        self._sampler = BatchSampler(self.train_tokens, self.seq_len, self.micro_batch_size, self.seed)
        _check_length(self.val_tokens, self.seq_len, "validation")  # now, not at the first evaluation

    def train_batch(self, step: int, micro_step: int = 0, dp_rank: Optional[int] = None,
                    dp_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 of shape ``(micro_batch_size, seq_len)``: rows
        `batch_rows` of the global batch of ``(step, micro_step)``, which depends only on those and
        the seed. ``dp_rank``/``dp_size`` default to this process's."""
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        return self._sampler.batch(step, micro_step, dp_rank, dp_size)

    def val_batches(self, n: int, dp_rank: Optional[int] = None,
                    dp_size: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` held-out batches, shaped as `train_batch`'s; the same on every call and every seed."""
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        return eval_batches(self.val_tokens, n, self.seq_len, self.micro_batch_size, dp_rank, dp_size)

    def batch_rows(self, dp_rank: Optional[int] = None, dp_size: Optional[int] = None) -> tuple[int, int]:
        """``(start, total)``: this rank's rows within the global micro-batch (for `bd.batch_slice`)."""
        dp_rank, dp_size = self._dp(dp_rank, dp_size)
        return dp_rank * self.micro_batch_size, dp_size * self.micro_batch_size

    def describe(self) -> str:
        m = self.manifest
        how = f"built in {m['build_s']:.1f} s" if self.built else f"loaded in {self.load_s:.2f} s (built in {m['build_s']:.1f} s)"
        skipped = f", {len(m['skipped'])} not UTF-8 skipped" if m["skipped"] else ""
        return (
            f"{m['files']} files, {m['bytes'] / 1e6:.1f} MB ({m['train_files']} train / {m['val_files']} held out{skipped}); "
            f"{len(self.train_tokens):,} train + {len(self.val_tokens):,} val tokens; "
            f"vocab {self.tokenizer.vocab_size} ({self.tokenizer.trained_vocab_size} {m.get('tokenizer', 'trained')}); "
            f"cache {self.cache_path}, {how}"
        )

    def _dp(self, dp_rank, dp_size):
        return (self.dp_rank if dp_rank is None else dp_rank), (self.dp_size if dp_size is None else dp_size)


def check_data(cfg) -> None:
    """The ``data`` group's rules: a source that exists, a vocabulary size the tokenizer supports,
    a held-out share in (0, 1), positive sizes."""
    check_choice("data.source", cfg.source, SOURCES)
    if cfg.source == RECORDS:
        record_files(cfg.path)
        named_shape(cfg)
    else:
        source_root(cfg.source, cfg.path)
    if not MIN_VOCAB <= cfg.vocab_size <= 1 << 32:
        raise ConfigError(f"data.vocab_size must be in [{MIN_VOCAB}, 2**32] (256 bytes and end-of-text), got {cfg.vocab_size}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.val_fraction}")
    for key in ("max_corpus_mb", "seq_len", "micro_batch_size"):
        check_positive(f"data.{key}", getattr(cfg, key))


# A token holds one byte of text at least; a document adds its end-of-text token and, with some
# models' tokenizers, a prefix: at most this many tokens beyond its bytes.
EXTRA_TOKENS_PER_FILE = 2


def check_corpus(cfg) -> tuple[Path, list[CorpusFile]]:
    """``(root, files)`` of the ``data`` group ``cfg`` (`list_files`: sizes only, nothing read), or a
    `ConfigError` when no file matches or their bytes cannot give two windows of tokens, one to
    train on and one held out (`balance_splits` finds the exact count once the text is tokenised).
    The launchers ask it before Hydra makes the run directory (`bigdense.jobs.run`)."""
    root, files = list_files(cfg.source, cfg.path, cfg.pattern, cfg.max_corpus_mb)
    n_bytes = sum(f.take for f in files)
    need = 2 * window(cfg.seq_len)
    if n_bytes + EXTRA_TOKENS_PER_FILE * len(files) < need:
        raise ConfigError(
            f"{source_name(cfg.source, cfg.path, root)}: {len(files)} file(s) of {n_bytes:,} bytes in all, too little "
            f"text for two windows of data.seq_len + 1 = {window(cfg.seq_len)} tokens (one to train on, one held "
            "out; a token holds a byte at least): lower data.seq_len, or give more text (data.path, data.max_corpus_mb)"
        )
    return root, files


def check_source(cfg, tokenizer: Optional[TokenizerFile] = None) -> None:
    """What the launchers check before the run directory exists: the corpus listed by size
    (`check_corpus`), or, for records, every record read, checked and tokenised into the cache
    (so a bad record stops the launch with nothing written to the run directory)."""
    if cfg.source == RECORDS:
        check_data(cfg)
        find_or_build(cfg, tokenizer)
    else:
        check_corpus(cfg)


def _agreed(compute: Callable[[], Any], key_of: Callable[[Any], str], cfg, ctx) -> Any:
    """``compute()`` on this rank, then (with a process group) the ranks agree: a rank that failed
    stops them all with its error, and ranks whose results differ in ``key_of`` (other files) stop
    with a `ConfigError`. One exchange, so no rank waits on one that failed."""
    try:
        value = compute()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        if not _distributed():
            raise
        value, error = None, e
    else:
        error = None
    if _distributed():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, (None if error else key_of(value), _report(error, ctx.rank)))
        if error is not None:
            raise error
        if any(report for _, report in found):
            _raise_peers([report for _, report in found], "")
        if len({k for k, _ in found}) > 1:
            raise ConfigError(
                f"the ranks see different corpora for data.source={cfg.source!r} (data.path={cfg.path!r}): "
                "every machine needs the same files"
            )
    return value


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# How long ranks wait for another rank's tokenizer and cache build (minutes for the default corpus).
BUILD_WAIT = datetime.timedelta(hours=2)


def _local_rank(rank: int) -> int:
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return rank


def _everywhere(selected: bool, fn: Callable[[], None], rank: int) -> None:
    """Run ``fn`` on the selected ranks while the others wait; if it fails anywhere, every rank
    raises (an exchange of error messages is the barrier, so no rank is left waiting on a dead one)."""
    error: Optional[BaseException] = None
    if selected:
        try:
            fn()
        except Exception as e:  # re-raised below, after the other ranks have heard of it
            error = e
    if _distributed():
        # The waiting ranks sit in this collective for as long as the build takes, which is not
        # bounded by parallel.timeout_s (meant for training's collectives): a group of its own.
        wait_group = dist.new_group(backend="gloo", timeout=BUILD_WAIT)
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, _report(error, rank), group=wait_group)
        dist.destroy_process_group(wait_group)
        if error is None and any(reports):
            _raise_peers(reports, "data preparation failed on another rank: ")
    if error is not None:
        raise error


def _report(error: Optional[BaseException], rank: int) -> Optional[tuple[bool, str]]:
    """What the other ranks hear of ``error``: whether it is a `ConfigError`, and its words."""
    if error is None:
        return None
    if isinstance(error, ConfigError):
        return True, str(error)
    return False, f"rank {rank}: {type(error).__name__}: {error}"


def _raise_peers(reports, prefix: str) -> None:
    """Raise the first failure another rank reported: a `ConfigError` as itself (every rank then
    ends with the same one line), anything else as a `RuntimeError` that says where it happened."""
    is_config, message = next(r for r in reports if r)
    if is_config:
        raise ConfigError(message)
    raise RuntimeError(prefix + message)


# The cost of a first build (BPE training plus encoding) per MB of text, seen from a quiet 2-core
# machine to a loaded one (0.6-1.6 s/MB for the 24 MB default), only to tell a person how long the
# silence before the first step will last; docs/performance.md has measurements.
BUILD_S_PER_MB = (0.5, 2.0)


def announce_build(files, vocab_size: int, path: Path, tokenizer: Optional[TokenizerFile] = None) -> None:
    mb = sum(f.take for f in files) / 2**20
    low, high = (max(2.0, rate * mb) for rate in BUILD_S_PER_MB)
    how = (f"tokenizing {mb:.1f} MB of text with {tokenizer.path}" if tokenizer else
           f"training a {vocab_size}-entry byte-level BPE vocabulary on {mb:.1f} MB of text and tokenizing it")
    log.info("data: first use of this corpus with this tokenizer: %s (%d files) into %s; this takes %.0f-%.0f "
             "s, depending on the machine (cached afterwards)", how, len(files), path, low, high)


def prepare_data(cfg, ctx=None, *, seed: int = 0, tokenizer: Optional[TokenizerFile] = None) -> Data | RecordData:
    """Build (once, on the main rank) or find the cache for ``cfg`` (a `DataConfig` or the ``data``
    node of a Hydra config), then memory-map it on every rank. ``data.source=records`` gives a
    `RecordData` (`bigdense.data.records`: the same batch interface, ``y`` masked with -100).

    ``tokenizer``: the model's own tokenizer (a fine-tuned model's ``tokenizer.json``), which then
    encodes the corpus and sets the vocabulary size, instead of a BPE trained on the corpus with
    ``data.vocab_size`` entries; the cache is kept per tokenizer.

    ``seed`` fixes the training batches (pass ``trainer.seed``). Every rank must call this together
    when torch.distributed is initialised. If the cache folder is not shared between machines, the
    first rank of each machine (``LOCAL_RANK`` 0) builds its own copy, which is identical because
    training is deterministic. All ranks must see the same files, or every rank raises.
    """
    from ..parallel.context import get_default_context

    check_data(cfg)
    ctx = ctx if ctx is not None else get_default_context()
    if cfg.source == RECORDS:  # every rank finds the cache or builds it under a lock, then the ranks agree
        return _agreed(lambda: prepare_records(cfg, ctx, seed=seed, tokenizer=tokenizer),
                       lambda data: data.manifest["key"], cfg, ctx)
    vocab_size = tokenizer.vocab_size if tokenizer else cfg.vocab_size
    t0 = time.perf_counter()

    def listed():
        root, files = check_corpus(cfg)
        return root, files, cache.fingerprint(cfg.source, root, files, vocab_size, cfg.val_fraction, tokenizer)

    root, files, key = _agreed(listed, lambda found: found[2], cfg, ctx)
    path = cache.cache_path(cfg.cache_dir, cfg.source, key)

    built = []

    def build_if_missing() -> None:
        if cache.load(path, key, vocab_size) is None:
            announce_build(files, vocab_size, path, tokenizer)
            manifest = cache.build(path, key, files, vocab_size, cfg.val_fraction, tokenizer)
            log.info("data: built in %.1f s; later runs with this corpus and vocabulary load it in a second",
                     manifest["build_s"])
            built.append(True)

    _everywhere(ctx.is_main, build_if_missing, ctx.rank)
    if _distributed():  # a cache folder local to each machine: its first rank builds it too
        _everywhere(_local_rank(ctx.rank) == 0 and not ctx.is_main, build_if_missing, ctx.rank)
    loaded = cache.load(path, key, vocab_size)
    if loaded is None:
        raise RuntimeError(f"the data cache {path} is missing or unreadable right after it was built")
    train, val = balance_splits(loaded.train, loaded.val, cfg.seq_len)
    if len(val) != len(loaded.val):
        short, other = ("held-out", "training") if len(val) > len(loaded.val) else ("training", "held-out")
        log.info("data: the %s split holds %d tokens, fewer than a window of data.seq_len + 1 = %d: it takes %d "
                 "from the %s split", short, min(len(loaded.train), len(loaded.val)), window(cfg.seq_len),
                 abs(len(val) - len(loaded.val)), other)
    return Data(
        tokenizer=loaded.tokenizer, train_tokens=train, val_tokens=val, seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size, seed=seed, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
        cache_path=path, manifest=loaded.manifest, built=bool(built), load_s=time.perf_counter() - t0,
    )
