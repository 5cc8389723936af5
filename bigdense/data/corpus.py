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
    a single file holds text (one given as ``data.path``, or the only one that decodes), whose tail
    is then held out."""

    train: list[str]
    val: list[str]
    n_bytes: int
    skipped: list[str] = field(default_factory=list)  # rel paths that are not UTF-8


RECORDS = "records"  # records to fine-tune on (`bigdense.data.records`), read by their own module
SOURCES = ("stdlib", "files", RECORDS)  # data.source: this Python's standard library, data.path's text, records


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
        raise ConfigError(f"{source_name(source, path, root)}: no non-empty file matches data.pattern={pattern!r}")
    return root, files


def source_name(source: str, path: str | None, root: Path) -> str:
    """The source as its config keys name it, for messages: ``data.path='notes.txt'``."""
    return f"data.path={path!r}" if source == "files" else f"data.source=stdlib ({root})"


def held_out_share(rel: str) -> float:
    """A number in [0, 1) fixed by the relative path alone: a file is held out when this is below
    ``data.val_fraction``, so the split does not change when other files come or go."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(files: Sequence[CorpusFile], val_fraction: float) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """``(train, val)`` by file. A corpus of two files or more always has at least one of each: if
    the hash leaves a side empty, the file closest to the threshold moves over. A single file is
    training text, whatever its hash (`read_corpus` holds out its tail)."""
    if len(files) == 1:
        return list(files), []
    val = [f for f in files if held_out_share(f.rel) < val_fraction]
    train = [f for f in files if held_out_share(f.rel) >= val_fraction]
    if not val:
        first = min(train, key=lambda f: held_out_share(f.rel))
        train.remove(first)
        val = [first]
    if not train:
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
    ``skipped``); the split is by file (`split_files`) among the files that hold text, and when only
    one does, within it: at the line nearest to ``1 - val_fraction`` of its text. Raises
    `ConfigError` when no file holds text."""
    texts: dict[str, str] = {}
    skipped: list[str] = []
    for f in files:
        try:
            text = _read(f)
        except UnicodeDecodeError:
            skipped.append(f.rel)
            continue
        if text:
            texts[f.rel] = text
    if not texts:
        raise ConfigError(no_text(files, skipped))
    if len(texts) == 1:
        (text,) = texts.values()
        train, val = split_text(text, val_fraction)
    else:
        train_files, val_files = split_files([f for f in files if f.rel in texts], val_fraction)
        train, val = [texts[f.rel] for f in train_files], [texts[f.rel] for f in val_files]
    n_bytes = sum(len(t.encode("utf-8")) for t in (*train, *val))
    return Corpus([t for t in train if t], [t for t in val if t], n_bytes, skipped)


def split_text(text: str, val_fraction: float) -> tuple[list[str], list[str]]:
    """``([head], [tail])`` of one document: cut after the last line end before ``1 - val_fraction``
    of its characters (there, when no line ends before)."""
    at = int(len(text) * (1.0 - val_fraction))
    cut = text.rfind("\n", 0, at)
    cut = cut + 1 if cut >= 0 else at
    return [text[:cut]], [text[cut:]]


def no_text(files: Sequence[CorpusFile], skipped: Sequence[str]) -> str:
    """Why ``files`` give no text: which are not UTF-8, which have no line end within the limit
    (``data.max_corpus_mb`` cut them before their first)."""
    cut = [f.rel for f in files if f.rel not in skipped]
    reasons = []
    if skipped:
        reasons.append(f"{_names(skipped)} {'is' if len(skipped) == 1 else 'are'} not UTF-8")
    if cut:
        reasons.append(f"{_names(cut)} {'has' if len(cut) == 1 else 'have'} no line end within data.max_corpus_mb")
    where = str(files[0].path) if len(files) == 1 else f"the {len(files)} files listed"
    return f"no text to train on in {where}: {'; '.join(reasons)}. Give UTF-8 text (data.path, data.pattern)"


def _names(rels: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(rels) - shown} more" if len(rels) > shown else ""
    return ", ".join(rels[:shown]) + more
