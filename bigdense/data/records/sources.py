"""Where records come from: the files or saved dataset ``data.path`` names, read with Hugging Face
``datasets`` (local files only; its cache under the data cache's directory), each row keeping the
file and line it came from, so a bad record's message can point at it.

    files = record_files("chats/*.jsonl")                  # or a file, a directory, a save_to_disk folder
    tables = read_tables(files, cache_dir, problems)       # [(RecordFile, datasets.Dataset), ...]

Formats by suffix (`FORMATS`); a directory holding ``dataset_dict.json`` or ``state.json`` is a
dataset saved with ``save_to_disk`` (`load_from_disk`), whose splits are named.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...errors import ConfigError

# data.path's file suffixes and the `datasets` builder that reads each.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk leaves in its folder
HELD_OUT_SPLITS = ("validation", "val", "test")  # a saved DatasetDict's held-out split, when data.val_split is unset


@dataclass(frozen=True)
class RecordFile:
    """One source of records: a file, or a saved dataset's ``split``."""

    path: Path
    builder: str  # a `FORMATS` value, or "disk"
    size: int
    split: Optional[str] = None

    def where(self, row: int) -> str:
        """The place of row ``row`` (0-based) for a message: JSON Lines and CSV by line, others by row."""
        if self.builder == "json" and self.path.suffix == ".jsonl":
            return f"{self.path}, line {row + 1}"
        if self.builder == "csv":
            return f"{self.path}, line {row + 2} (row {row + 1} after the header)"
        split = f" split {self.split!r}" if self.split else ""
        return f"{self.path}{split}, row {row}"


class Problems:
    """Bad records: raised at once as a `ConfigError`, or (``skip``) counted and kept for the log."""

    def __init__(self, skip: bool):
        self.skip, self.messages = skip, []

    def report(self, message: str) -> None:
        if not self.skip:
            raise ConfigError(message + " (or set data.skip_bad_records=true to skip such records, counted in the log)")
        self.messages.append(message)


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in SAVED_MARKERS)


def record_files(path: Optional[str], key: str = "data.path") -> list[RecordFile]:
    """The sources ``path`` names, in sorted order: one file, a saved dataset, a directory's files of a
    known format (recursively) or a glob's matches. A `ConfigError` naming ``key`` when there is none."""
    if not path:
        raise ConfigError(f"data.source=records needs {key} (a .jsonl/.json/.parquet/.csv/.arrow file, a directory "
                          "of them, a glob, or a folder written by datasets' save_to_disk)")
    p = Path(path).expanduser()
    if glob.has_magic(str(p)):
        found = [Path(m) for m in sorted(glob.glob(str(p), recursive=True)) if Path(m).is_file() or is_saved_dataset(Path(m))]
    elif is_saved_dataset(p) or p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FORMATS)
    else:
        raise ConfigError(f"{key}={path!r} does not exist")
    if not found:
        raise ConfigError(f"{key}={path!r}: no record file there (suffixes {sorted(FORMATS)}, or a save_to_disk folder)")
    return [_record_file(f, key) for f in found]


def _record_file(path: Path, key: str) -> RecordFile:
    if is_saved_dataset(path):
        return RecordFile(path.resolve(), "disk", sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
    if path.suffix not in FORMATS:
        raise ConfigError(f"{key}: {path} is not a record file: expected one of the suffixes {sorted(FORMATS)} "
                          "(or a folder written by datasets' save_to_disk)")
    return RecordFile(path.resolve(), FORMATS[path.suffix], path.stat().st_size)


def read_tables(files: list[RecordFile], cache_dir: Path, problems: Problems, split: str = "train",
                val_split: Optional[str] = None):
    """``[(RecordFile, Dataset)]`` for ``split`` ("train" or "val"): every file for "train", a saved
    DatasetDict's held-out split for "val" (none for plain files, whose held-out records are
    ``data.val_path``'s or a fraction). An empty file or one that does not parse is a bad record."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never the network
    import datasets

    datasets.disable_progress_bars()
    out = []
    for f in files:
        if f.builder == "disk":
            table = _saved_split(f, split, val_split)
            if table is not None:
                out.append(table)
            continue
        if split != "train":
            continue
        if f.size == 0:
            problems.report(f"{f.where(0)}: the file is empty")
            continue
        try:
            table = datasets.load_dataset(f.builder, data_files=[str(f.path)], split="train",
                                          cache_dir=str(cache_dir))
        except Exception as e:  # noqa: BLE001 -- reworded with the line, below
            table = _unparsed(f, e, problems)
            if table is None:
                continue
        out.append((f, table))
    return out


def _saved_split(f: RecordFile, split: str, val_split: Optional[str]):
    import datasets

    saved = datasets.load_from_disk(str(f.path))
    if isinstance(saved, datasets.Dataset):
        return (f, saved) if split == "train" else None
    names = list(saved)
    if split == "train":
        if "train" not in names and len(names) != 1:
            raise ConfigError(f"data.path: {f.path} holds the splits {names} and none is 'train'")
        name = "train" if "train" in names else names[0]
    else:
        if val_split is not None and val_split not in names:
            raise ConfigError(f"data.val_split={val_split!r} is not a split of {f.path} (it holds {names})")
        name = val_split or next((n for n in HELD_OUT_SPLITS if n in names), None)
        if name is None:
            return None
    return RecordFile(f.path, "disk", f.size, split=name), saved[name]


def _unparsed(f: RecordFile, error: Exception, problems: Problems):
    """A file `datasets` could not read: the first line that does not parse (JSON Lines, where its
    lines that parse are kept with ``data.skip_bad_records``), else the reader's own words."""
    if f.path.suffix != ".jsonl":
        problems.report(f"{f.path}: cannot be read as {f.builder}: {type(error).__name__}: {str(error)[:300]}")
        return None
    import datasets

    rows, types = [], {}
    for i, line in enumerate(f.path.read_text(encoding="utf-8", errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as e:
            problems.report(f"{f.where(i)}: not a JSON object: {e}")
            continue
        clash = next((k for k, v in record.items() if v is not None and types.setdefault(k, type(v)) is not type(v)), None)
        if clash is not None:
            problems.report(f"{f.where(i)}, field {clash!r}: a {type(record[clash]).__name__} where earlier lines "
                            f"hold a {types[clash].__name__}")
            continue
        rows.append(record)
    if not rows:
        problems.report(f"{f.where(0)}: no record parses")
        return None
    return datasets.Dataset.from_list(rows)
