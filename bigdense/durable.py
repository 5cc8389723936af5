"""Files and directories that appear whole or not at all, and stay after a crash once they appear.

A writer builds a private hidden sibling (`hidden_sibling`), fsyncs what it wrote (`fsync_tree`,
`write_bytes_durably`) and renames it into place as its last act (`rename_into_place`), so a name
that exists always holds something complete, and an interrupted writer leaves only a hidden
sibling. Small pointer files are replaced the same way (`replace_text_durably`). The checkpoints
and the data cache both publish through these.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(path) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path) -> None:
    """fsync every file directly in the directory ``path``, then the directory itself."""
    path = Path(path)
    for p in path.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def write_bytes_durably(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_text_durably(path, text: str, tmp_suffix: str) -> None:
    """Atomically replace ``path`` by a file holding ``text`` (temporary name, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{tmp_suffix}")
    write_bytes_durably(tmp, text.encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def unique_token() -> str:
    """A token no other process (here or on another machine of a shared filesystem) picks."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def hidden_sibling(final, tag: str, token: str | None = None) -> Path:
    """``<parent>/.<name>.<tag>-<token>``: where a writer builds ``final`` before publishing it."""
    final = Path(final)
    return final.with_name(f".{final.name}.{tag}-{token or unique_token()}")


def rename_into_place(tmp, final) -> None:
    """Publish the finished ``tmp`` under ``final`` (which must not exist) and make the rename durable."""
    os.rename(tmp, final)
    fsync_dir(Path(final).parent)
