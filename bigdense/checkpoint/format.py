"""The on-disk format: one directory per checkpoint, safetensors shard files, a JSON manifest.

    step_1000/
      manifest.json                   written last; its presence marks the directory complete
      model-tp00-of-02.safetensors    model tensors of TP rank 0 (at dp > 1, one file per writing
      model-tp00-of-02-dp01-of-02.safetensors   DP replica: the replicas share out the tensors)
      optim-tp00-of-02.safetensors    optimizer tensors (Adam moments, step counters) likewise
      common.pt                       replicated non-tensor state: optimizer hyper-parameters,
                                      scheduler, loss scaler (torch.save, loaded weights_only)
      rank00000.pt ...                per-rank state: RNG states and ``extra``
    latest                            beside the checkpoints: the name of the last complete one

Every stored tensor is a box of its global tensor: ``offsets`` and ``shape`` in global
coordinates. A sharded parameter has one box per TP rank (bigdense's balanced split, uneven
included); a replicated one has a single box covering it all. A reader at another layout copies
the intersection of each stored box with the box it needs, so resharding is a box-overlap
question and nothing depends on how the writer split the tensor.

A model with low-rank adapters is stored as its adapters and their optimizer state only; the
manifest's ``lora`` record then names the frozen base they need (`bigdense.checkpoint.lora_state`).

This module is free of process groups: the offline tools (`export_dense`) use it alone. Box
arithmetic is in `boxes`.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from .digest import Hasher, file_matches, matches

FORMAT_NAME = "bigdense.checkpoint"
FORMAT_VERSION = 2  # 2: files may be per (TP, DP) rank; checksums are tagged ``hash`` values
MANIFEST = "manifest.json"
COMMON = "common.pt"
LATEST = "latest"
RUN_CHECKPOINTS = "checkpoints"  # a training run directory keeps its checkpoints (and `latest`) here

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the tensor."""


class CheckpointMismatch(CheckpointError):
    """A complete, readable checkpoint of another model: a tensor is missing, extra, or of another
    global shape. Whoever chose the checkpoint can say what to do (`bigdense.jobs`)."""


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a safetensors file")
    return _DTYPES[dtype]


def dtype_from_code(code: str) -> torch.dtype:
    if code not in _FROM_CODE:
        raise CheckpointError(f"unknown safetensors dtype {code!r}")
    return _FROM_CODE[code]


def shard_file_name(kind: str, tp_rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1) -> str:
    """``model-tp01-of-04.safetensors`` (``...-dp01-of-02.safetensors`` at dp > 1): the file of
    ``kind`` written by the rank at (``tp_rank``, ``dp_rank``)."""
    dp = f"-dp{dp_rank:02d}-of-{dp_size:02d}" if dp_size > 1 else ""
    return f"{kind}-tp{tp_rank:02d}-of-{tp_size:02d}{dp}.safetensors"


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _raw_bytes(tensor: torch.Tensor):
    """A zero-copy byte view of a contiguous CPU tensor (0-d and empty tensors included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------------
# writing


def write_safetensors(
    path,
    layout: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    produce: Callable[[str], torch.Tensor],
    metadata: Optional[dict] = None,
) -> dict:
    """Write a safetensors file one tensor at a time and fsync it; return ``{name: digest}``.

    ``layout`` lists ``(name, dtype, shape)`` in file order (the header comes first);
    ``produce(name)`` returns each tensor when its turn comes, so only one tensor's CPU copy is
    alive at a time -- `export_dense` assembles full tensors this way in O(largest tensor) memory.
    Each tensor is hashed from the bytes being written (`digest`), not read back.
    """
    header, offset = {}, 0
    for name, dtype, shape in layout:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digests = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in layout:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(
                    f"{path}: tensor {name!r} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}"
                )
            data = _raw_bytes(t.detach().to("cpu").contiguous())
            digests[name] = Hasher().update(data).hexdigest()
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digests


# ---------------------------------------------------------------------------------------------
# reading


class SafetensorsReader:
    """Zero-copy access to the tensors of one safetensors file through ``mmap``.

    `view(name)` is a tensor over the mapped bytes: slicing it and copying the slice out reads only
    the pages that slice touches, so a resharding load costs O(the overlap), not O(the stored shard).
    The mapping is copy-on-write, so nothing a caller does can reach the file.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: shard file is missing") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: file is truncated ({size} bytes, no safetensors header)")
            (header_len,) = struct.unpack("<Q", self._file.read(8))
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{self.path}: file is truncated (header claims {header_len} bytes, file has {size})"
                )
            try:
                self.header = json.loads(self._file.read(header_len))
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: corrupted safetensors header ({exc})") from None
            self.metadata = self.header.pop("__metadata__", None) or {}
            self._base = 8 + header_len
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else None
            self._size = size
        except BaseException:
            self._file.close()
            raise

    def _entry(self, name: str):
        if name not in self.header:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in this file (missing shard)")
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        if self._base + end > self._size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {self._base + end} but the file has "
                f"{self._size} bytes (truncated)"
            )
        return entry, self._base + begin, self._base + end

    def describe(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        entry, _, _ = self._entry(name)
        return dtype_from_code(entry["dtype"]), tuple(entry["shape"])

    def matches(self, name: str, record: dict) -> bool:
        """Whether tensor ``name``'s stored bytes hash to the digest the manifest ``record`` holds."""
        _, begin, end = self._entry(name)
        return matches(record, memoryview(self._mm)[begin:end] if end > begin else b"")

    def nbytes(self, name: str) -> int:
        _, begin, end = self._entry(name)
        return end - begin

    def view(self, name: str) -> torch.Tensor:
        entry, begin, end = self._entry(name)
        dtype, shape = dtype_from_code(entry["dtype"]), tuple(entry["shape"])
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(memoryview(self._mm)[begin:end], dtype=dtype).view(shape)

    def release(self, name: str) -> None:
        """Drop the pages of tensor ``name`` that reading it brought into this process (they count
        in its resident set while mapped): a reader going through a big file tensor by tensor then
        holds one tensor's pages at a time. The mapping is private and never written, so a later
        read of the tensor reads the file again."""
        if self._mm is None or not hasattr(self._mm, "madvise"):
            return
        _, begin, end = self._entry(name)
        start = begin - begin % mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# locating a checkpoint


def resolve_checkpoint(path) -> Path:
    """The checkpoint directory ``path`` names: the directory itself, or what a ``latest`` pointer says.

    ``path`` may be a checkpoint directory, a pointer file (``runs/x/checkpoints/latest``), a
    directory of checkpoints that holds a ``latest`` pointer (``runs/x/checkpoints``), or a training
    run directory (``runs/x``: its ``checkpoints/``).
    """
    path = Path(path)
    rolled_forward = None
    path = _run_checkpoints(path)
    if path.is_dir() and not (path / MANIFEST).exists() and (path / LATEST).is_file():
        path = path / LATEST
    if not path.exists():
        rolled_forward = swapped_out_checkpoint(path)
        path = rolled_forward or path
    if path.is_file():
        name = path.read_text().strip()
        if not name or "/" in name or name in (".", ".."):
            raise CheckpointError(f"{path}: not a checkpoint pointer (expected the name of a checkpoint directory)")
        target = path.parent / name
        if not target.is_dir():
            rolled_forward = swapped_out_checkpoint(target)
            if rolled_forward is None:
                raise CheckpointError(f"{path} names checkpoint {name!r}, but {target} does not exist")
            target = rolled_forward
        path = target
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory or pointer file")
    if path.name.startswith(".") and (".tmp-" in path.name or ".old-" in path.name) and path != rolled_forward:
        raise CheckpointError(f"{path} is the temporary directory of an unfinished save, not a checkpoint")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(_not_a_checkpoint(path))
    return path


def _run_checkpoints(path: Path) -> Path:
    """A run directory's ``checkpoints/`` (refused when it holds no complete checkpoint yet); any
    other path as it is."""
    inner = path / RUN_CHECKPOINTS
    if not path.is_dir() or (path / MANIFEST).exists() or (path / LATEST).exists() or not inner.is_dir():
        return path
    if not (inner / LATEST).is_file():
        raise CheckpointError(f"{path} is a run directory, but {inner} holds no complete checkpoint yet "
                              f"(no `{LATEST}` pointer: the run saved none, or was stopped during its first save)")
    return inner


def _not_a_checkpoint(path: Path) -> str:
    """Why a directory without a manifest is no checkpoint, and what to give instead."""
    saved = sorted(p.name for p in path.glob("step_*") if (p / MANIFEST).is_file())
    if saved:
        return (f"{path} holds checkpoints but no `{LATEST}` pointer; name one of them, e.g. {path / saved[-1]}")
    if any(path.glob("*.safetensors")) or any(path.glob("rank*.pt")):
        return (f"{path} is not a complete bigdense checkpoint: it has no {MANIFEST} (an interrupted save "
                f"leaves such a directory; load an earlier checkpoint or `{LATEST}`)")
    return (f"{path} is not a bigdense checkpoint (no {MANIFEST}); give a checkpoint directory "
            f"(RUN/{RUN_CHECKPOINTS}/step_0000100), a run's {RUN_CHECKPOINTS}/ or its `{LATEST}`, or the run "
            f"directory itself")


def swapped_out_checkpoint(final: Path) -> Optional[Path]:
    """The complete new copy of ``final`` when a re-save of that name died between its two renames.

    Re-saving a name moves the old directory aside, then renames the new one into place; a crash
    between the two leaves ``final`` missing and the new copy, manifest and all, under its
    temporary name. That copy is a complete checkpoint (the manifest is written last): the save
    rolls it forward, and loading reads it where it is.
    """
    done = [p for p in final.parent.glob(f".{final.name}.tmp-*") if (p / MANIFEST).is_file()]
    return max(done, key=lambda p: (p / MANIFEST).stat().st_mtime) if done else None


def read_manifest(ckpt_dir: Path) -> dict:
    """The manifest of a checkpoint directory, checked for format and version."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}: corrupted manifest ({exc})") from None
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a bigdense checkpoint manifest (format={manifest.get('format')!r})")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest['version']} is newer than this bigdense reads ({FORMAT_VERSION})"
        )
    return manifest


def check_files(ckpt_dir: Path, manifest: dict, names: Optional[Iterable[str]] = None) -> None:
    """The files ``names`` (default: all the manifest lists) exist with the size they were written
    with, and the small pickled ones with their checksum: catches missing and truncated files
    before anything is read. A loading rank checks only the files it reads, so no rank touches
    every other rank's files."""
    for name in manifest["files"] if names is None else names:
        info = manifest["files"].get(name)
        path = Path(ckpt_dir) / name
        if info is None:
            raise CheckpointError(f"{path}: not listed in the manifest (saved at a different layout?)")
        held = [k for k, e in manifest["tensors"].items() if any(s["file"] == name for s in e["shards"])]
        holds = f" (it holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''})" if held else ""
        if not path.is_file():
            raise CheckpointError(f"{path}: file listed in the manifest is missing{holds}")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"{path}: expected {info['bytes']} bytes, found {size} (truncated or overwritten){holds}"
            )
        if not file_matches(info, path):
            raise CheckpointError(f"{path}: checksum mismatch (corrupted)")


def load_pickled(path: Path):
    """A small state file written with torch.save; loaded with ``weights_only`` (no code runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
