"""Retention: keep the newest N complete checkpoints of a directory, remove the rest safely."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..durable import hidden_sibling
from .format import LATEST, MANIFEST, CheckpointError, read_manifest


def remove_beyond(parent: Path, keep_last: int, keep: Path) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints in ``parent`` (newest by saved
    step, then by creation time); never ``keep`` (the one just written), never the one ``latest``
    names, and never a save in progress (hidden temporary directories are not checkpoints).

    Each removal first renames the directory to a hidden name, so a crash midway never leaves a
    half-deleted directory that still looks complete. Returns the directories removed.
    """
    pointer = parent / LATEST
    latest = pointer.read_text().strip() if pointer.is_file() else None
    found = []
    for d in parent.iterdir():
        if d.name.startswith(".") or not d.is_dir() or not (d / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            continue  # not ours to remove
        step = manifest.get("step")
        found.append((step if isinstance(step, int) else -1, manifest.get("created_unix", 0.0), d))
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    doomed = [d for _, _, d in found[keep_last:] if d != keep and d.name != latest]
    for d in doomed:
        tomb = hidden_sibling(d, "removing")
        os.rename(d, tomb)
        shutil.rmtree(tomb, ignore_errors=True)
    return doomed
