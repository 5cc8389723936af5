"""The on-disk cache of a prepared corpus: tokenizer, token arrays and a manifest.

One folder per fingerprint of everything that determines its contents. A build writes a private
temporary folder and renames it into place as its last act, so a folder under the final name is
always complete; an interrupted build leaves only a ``.partial-*`` folder, which is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..durable import fsync_tree, hidden_sibling, rename_into_place
from .corpus import CorpusFile, read_corpus
from .tokenizer import EOT, BPETokenizer, TokenizerFile, library_version

# Bump when the contents of a cache folder change meaning (tokenizer options, array layout, ...).
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def cache_root(cache_dir: str | None) -> Path:
    """``data.cache_dir``, else ``$BIGDENSE_CACHE``, else ``~/.cache/bigdense``."""
    root = cache_dir or os.environ.get("BIGDENSE_CACHE") or Path.home() / ".cache" / "bigdense"
    return Path(root).expanduser()


def fingerprint(source: str, root: Path, files: Sequence[CorpusFile], vocab_size: int, val_fraction: float,
                tokenizer: Optional[TokenizerFile] = None) -> str:
    """Hex digest of the inputs of a build. Files count by relative path and size (not contents, not
    mtime), so identical installs on different machines agree; a file edited in place to the same
    size is not noticed. ``files`` of a ``files`` source are also keyed by their directory. A
    model's own ``tokenizer`` counts by its contents (one cache per tokenizer)."""
    doc = {
        "format": FORMAT_VERSION,
        "tokenizers": library_version(),
        "source": source,
        # The stdlib is identified by its version, so it may live at different paths on different machines.
        "where": platform.python_version() if source == "stdlib" else str(root),
        "files": [[f.rel, f.size, f.take] for f in files],
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
    }
    if tokenizer is not None:
        doc["tokenizer"] = tokenizer.digest()
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | None, source: str, key: str) -> Path:
    return cache_root(cache_dir) / "data" / f"{source}-{key[:20]}"


@dataclass
class Loaded:
    """A cache folder opened for reading; the arrays are read-only memory maps."""

    tokenizer: BPETokenizer
    train: np.ndarray
    val: np.ndarray
    manifest: dict


def load(path: Path, key: str, vocab_size: int) -> Loaded | None:
    """The cache at ``path``, or None when it is absent, of another key, or inconsistent."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("key") != key:
            return None
        train = np.load(path / "train.npy", mmap_mode="r")
        val = np.load(path / "val.npy", mmap_mode="r")
        if (len(train), len(val)) != (manifest["train_tokens"], manifest["val_tokens"]):
            return None
        tokenizer = BPETokenizer.load(path / "tokenizer.json", vocab_size, manifest.get("eot", EOT))
    except Exception:  # any unreadable or inconsistent folder is a miss, to be rebuilt
        return None
    return Loaded(tokenizer, train, val, manifest)


def build(path: Path, key: str, files: Sequence[CorpusFile], vocab_size: int, val_fraction: float,
          tokenizer_file: Optional[TokenizerFile] = None) -> dict:
    """Read, train (unless ``tokenizer_file`` gives the tokenizer), encode and publish the cache at
    ``path``; returns the manifest.

    Safe against a concurrent builder of the same key (the first rename wins, the other result is
    dropped) and against interruption (nothing appears under ``path`` until it is complete).
    """
    t0 = time.perf_counter()
    corpus = read_corpus(files, val_fraction)  # a ConfigError when no file holds text
    tokenizer = tokenizer_file.load() if tokenizer_file else BPETokenizer.train(corpus.train, vocab_size)
    train = tokenizer.encode_documents(corpus.train)
    val = tokenizer.encode_documents(corpus.val)
    manifest = {
        "key": key,
        "files": len(files),
        "train_files": len(corpus.train),
        "val_files": len(corpus.val),
        "skipped": corpus.skipped,
        "bytes": corpus.n_bytes,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "vocab_size": vocab_size,
        "trained_vocab_size": tokenizer.trained_vocab_size,
        "eot": tokenizer.eot,
        "tokenizer": str(tokenizer_file.path) if tokenizer_file else "trained",
        "tokenizers": library_version(),
        "build_s": round(time.perf_counter() - t0, 2),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(path, "partial")
    tmp.mkdir()
    try:
        tokenizer.save(tmp / "tokenizer.json")
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_tree(tmp)
        publish(tmp, path, lambda p: load(p, key, vocab_size) is not None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def publish(tmp: Path, path: Path, complete: Callable[[Path], bool]) -> None:
    """``tmp`` renamed to ``path``. A folder already there that is ``complete`` (another builder
    got there first with the same inputs) is kept; anything else there (not made by a build, or
    broken) is moved aside first."""
    try:
        rename_into_place(tmp, path)
        return
    except OSError:
        if not path.exists():
            raise
    if complete(path):
        return
    stale = hidden_sibling(path, "stale")
    os.rename(path, stale)
    shutil.rmtree(stale, ignore_errors=True)
    rename_into_place(tmp, path)
