"""The text corpus: which files are read, in which order, and which of them are held out.

Everything here is a pure function of the files on disk and the ``data`` config, so every rank (and
every machine with the same files) computes the same list, the same split and the same fingerprint.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError, check_choice

# Never part of "the standard library": third-party code lives there, and differs between machines.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusFile:
    """One file of the corpus. ``rel`` (POSIX, relative to the source root) is its identity for the
    split and the cache fingerprint; only its first ``take`` bytes are read (< ``size`` for the file
    that reaches ``data.max_corpus_mb``)."""

    rel: str
    path: Path
    size: int
    take: int


@dataclass
class Corpus:
    """Decoded text, one string per document. ``train`` and ``val`` never share a file, except when
    the source is a single file, whose tail is then held out."""

    train: list[str]
    val: list[str]
    n_bytes: int
    skipped: list[str] = field(default_factory=list)  # rel paths that are not UTF-8


SOURCES = ("stdlib", "files")  # data.source: this Python's standard library, or data.path


def source_root(source: str, path: str | None) -> Path:
    """The directory (or single file) that ``data.source``/``data.path`` name; a clear error if none."""
    check_choice("data.source", source, SOURCES)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise ConfigError(f"data.source=stdlib: this Python's standard library {str(root)!r} is not a directory")
        return root
    if source == "files":
        if not path:
            raise ConfigError("data.source=files needs data.path (a directory or a file of UTF-8 text)")
        root = Path(path).expanduser()
        if not root.exists():
            raise ConfigError(f"data.path={path!r} does not exist")
    return root.resolve()


def _matches(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    # Glob semantics of pathlib: "**" is zero or more directories, other parts match one name each.
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def list_files(source: str, path: str | None, pattern: str, max_corpus_mb: float) -> tuple[Path, list[CorpusFile]]:
    """``(root, files)``: the files of the source in sorted order of their relative path, up to
    ``max_corpus_mb`` megabytes (10**6 bytes) in all. Only sizes are read, not contents.

    A single file given as ``data.path`` is taken as it is (``pattern`` is not applied).
    """
    root = source_root(source, path)
    limit = int(max_corpus_mb * 1e6)
    if root.is_file():
        found = [(root.name, root)]
    else:
        pat = [p for p in pattern.split("/") if p]
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            base = Path(dirpath)
            rel_dir = base.relative_to(root).parts
            for name in filenames:
                if _matches((*rel_dir, name), pat):
                    found.append(("/".join((*rel_dir, name)), base / name))
        found.sort()
    files, total = [], 0
    for rel, p in found:
        if total >= limit:
            break
        size = p.stat().st_size
        if size == 0:
            continue
        take = min(size, limit - total)
        files.append(CorpusFile(rel, p, size, take))
        total += take
    if not files:
        where = f"data.path={path!r}" if source == "files" else f"data.source=stdlib ({root})"
        raise ConfigError(f"{where}: no non-empty file matches data.pattern={pattern!r}")
    return root, files


def held_out_share(rel: str) -> float:
    """A number in [0, 1) fixed by the relative path alone: a file is held out when this is below
    ``data.val_fraction``, so the split does not change when other files come or go."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(files: Sequence[CorpusFile], val_fraction: float) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """``(train, val)`` by file. A corpus of two files or more always has at least one of each: if
    the hash leaves a side empty, the file closest to the threshold moves over."""
    val = [f for f in files if held_out_share(f.rel) < val_fraction]
    train = [f for f in files if held_out_share(f.rel) >= val_fraction]
    if len(files) >= 2 and not val:
        first = min(train, key=lambda f: held_out_share(f.rel))
        train.remove(first)
        val = [first]
    if len(files) >= 2 and not train:
        last = max(val, key=lambda f: held_out_share(f.rel))
        val.remove(last)
        train = [last]
    return train, val


def _read(f: CorpusFile) -> str:
    with open(f.path, "rb") as fh:
        raw = fh.read(f.take)
    if f.take < f.size:
        # Cut at a line end: the limit must not split a line, nor a multi-byte character.
        cut = raw.rfind(b"\n")
        raw = raw[: cut + 1] if cut >= 0 else b""
    return raw.decode("utf-8")


def read_corpus(files: Sequence[CorpusFile], val_fraction: float) -> Corpus:
    """Decode the files and split them. Files that are not valid UTF-8 are skipped (listed in
    ``skipped``); a single file is split at the line nearest to ``1 - val_fraction`` of its text."""
    train_files, val_files = split_files(files, val_fraction)
    skipped: list[str] = []

    def decode(group):
        out = []
        for f in group:
            try:
                text = _read(f)
            except UnicodeDecodeError:
                skipped.append(f.rel)
                continue
            if text:
                out.append(text)
        return out

    train, val = decode(train_files), decode(val_files)
    if len(files) == 1 and train:
        text = train[0]
        cut = text.rfind("\n", 0, int(len(text) * (1.0 - val_fraction)))
        cut = cut + 1 if cut >= 0 else int(len(text) * (1.0 - val_fraction))
        train, val = [text[:cut]], [text[cut:]]
    n_bytes = sum(len(t.encode("utf-8")) for t in (*train, *val))
    return Corpus([t for t in train if t], [t for t in val if t], n_bytes, skipped)
