"""Plain PyTorch interop: export a checkpoint as one unsharded file, import a dense state dict;
`CheckpointTensors`, the assembly of global tensors from shard files that every export shares.

bigdense layers keep ``nn.Linear``/``nn.Embedding`` parameter names (``weight``, ``bias``), and
`parallelize` keeps module paths, so the global tensors of a checkpoint carry exactly the names of
the plain PyTorch twin of the model: the exported file loads into it with ``load_state_dict``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from torch import nn

from ._agree import agree
from .boxes import narrow_box
from .format import (
    FORMAT_NAME, CheckpointError, SafetensorsReader, check_files, dtype_from_code, read_manifest, resolve_checkpoint,
    write_safetensors,
)
from ..durable import hidden_sibling
from ..parallel.sharding import is_world_sharded
from .adapters import resolve_optimizer
from .pieces import current_context, model_pieces, unwrap
from .split import SplitOptimizerState


class CheckpointTensors:
    """The model tensors of a checkpoint, each assembled whole from its shard files when asked for.

    Offline: one process, no process group, any saved layout. ``names`` maps each model tensor's
    name (the plain module name) to its manifest entry; ``aliases`` maps a tied name to the name it
    is stored under. `assemble` builds one global tensor from the boxes on disk, verifying each
    shard's checksum first (``verify``), so a caller that writes each tensor before asking for the
    next holds O(largest tensor). The shard files stay memory-mapped until `close` (or the end of a
    ``with`` block). Catches missing and truncated shard files on construction.
    """

    def __init__(self, ckpt: Path, manifest: dict, *, verify: bool = True):
        self.ckpt, self.verify = Path(ckpt), verify
        self._entries = manifest["tensors"]
        self.names = {k[len("model/"):]: k for k in self._entries if k.startswith("model/")}
        self.aliases: dict[str, str] = manifest.get("aliases", {})
        files = {s["file"] for k in self.names.values() for s in self._entries[k]["shards"]}
        check_files(self.ckpt, manifest, sorted(files))
        self._readers: dict[str, SafetensorsReader] = {}

    def shape(self, name: str) -> list[int]:
        return self._entries[self.names[name]]["global_shape"]

    def stored_dtype(self, name: str) -> torch.dtype:
        return dtype_from_code(self._entries[self.names[name]]["dtype"])

    def out_dtype(self, name: str, dtype: Optional[torch.dtype]) -> torch.dtype:
        """``dtype`` for a floating-point tensor when given; the stored dtype otherwise."""
        stored = self.stored_dtype(name)
        return dtype if dtype is not None and stored.is_floating_point else stored

    def assemble(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Global tensor ``name``, copied out of its shards and cast to `out_dtype`."""
        entry = self._entries[self.names[name]]
        full = torch.empty(entry["global_shape"], dtype=self.out_dtype(name, dtype))
        for shard in entry["shards"]:
            reader = self._reader(shard["file"])
            if self.verify and not reader.matches(shard["name"], shard):
                raise CheckpointError(
                    f"{self.ckpt / shard['file']}: tensor {shard['name']!r} fails its checksum (corrupted file)"
                )
            narrow_box(full, [0] * full.dim(), shard["offsets"], shard["shape"]).copy_(reader.view(shard["name"]))
        return full

    def _reader(self, file: str) -> SafetensorsReader:
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(self.ckpt / file)
        return self._readers[file]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def export_dense(ckpt_path, out_file, *, dtype: Optional[torch.dtype] = None, verify: bool = True) -> Path:
    """Write the model of checkpoint ``ckpt_path`` as ONE unsharded safetensors file ``out_file``.

    Offline: one process, no process group, any saved layout. Names are the plain module names.
    A tied tensor is written once, under its first name (the input embedding's, as Hugging Face
    does); the file's metadata ``"tied"`` maps the other names to it (JSON). So
    ``safetensors.torch.load_model(plain_model, out_file)`` loads it into a tied plain model (it
    knows tied names), as does `load_dense_state_dict` into a sharded one. Each global tensor
    is assembled from the shard files on disk and written before the next one is built: memory is
    O(largest tensor). Shard checksums are verified (``verify``). ``dtype`` casts floating-point
    tensors (e.g. ``torch.bfloat16`` for a smaller file). The file appears atomically.
    """
    ckpt = resolve_checkpoint(ckpt_path)
    out_file = Path(out_file)
    tmp = hidden_sibling(out_file, "tmp")
    with CheckpointTensors(ckpt, read_manifest(ckpt), verify=verify) as stored:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            layout = [(n, stored.out_dtype(n, dtype), stored.shape(n)) for n in sorted(stored.names)]
            metadata = {"format": "pt", "source": f"{FORMAT_NAME}:{ckpt.name}",
                        "tied": json.dumps(stored.aliases, sort_keys=True)}
            write_safetensors(tmp, layout, lambda name: stored.assemble(name, dtype), metadata)
            os.replace(tmp, out_file)
        finally:
            tmp.unlink(missing_ok=True)
    return out_file


def load_dense_state_dict(
    model,
    state_dict: Union[Mapping[str, torch.Tensor], str, os.PathLike],
    *,
    strict: bool = True,
    optimizer=None,
) -> list[str]:
    """Load a plain (unsharded) state dict into a sharded model: each rank copies its own slice.

    ``state_dict``: a mapping of full tensors (``plain_model.state_dict()``), or the path of a
    safetensors file (such as `export_dense` writes), which is memory-mapped so each rank reads only
    its own slices. Names are the plain model's; sharded parameters take their slice per the
    layers' ``bd_shard_specs()``, replicated ones the whole tensor. ``model`` may be an
    ``nn.Module``, a DDP wrapper, a DeepSpeedEngine or a bigdense engine (``bd.build_engine``'s);
    the fp32 master weights of the optimizer (``optimizer``, else the engine's) are set to the
    loaded values too -- DeepSpeed's, and those of world-sharded parameters, which bigdense's
    `DSEngine` steps beside DeepSpeed (pass that engine, not its ``.ds``).

    Collective when distributed (every rank calls it): names and global shapes are checked on every
    rank and agreed on before any parameter changes. ``strict``: the names must match exactly.
    Returns the model tensors not found (empty when ``strict``).
    """
    if not isinstance(model, nn.Module) and hasattr(model, "checkpoint_state"):  # a bigdense engine
        parts = model.checkpoint_state()
        model, optimizer = parts["model"], optimizer if optimizer is not None else parts["optimizer"]
    module, engine = unwrap(model)
    adapter = resolve_optimizer(optimizer, engine)
    _check_masters_reachable(module, engine, adapter)
    ctx = current_context()
    source = str(state_dict) if isinstance(state_dict, (str, os.PathLike)) else "the state dict"
    plan = agree(f"load_dense_state_dict({source})",
                 lambda: _plan_dense_load(module, state_dict, source, strict, ctx.tp_rank, ctx.tp_size))
    agree(f"load_dense_state_dict({source}): applying", lambda: _apply_dense_load(plan, state_dict, adapter))
    return plan.missing


@dataclass
class _DenseLoadPlan:
    reader: Optional[SafetensorsReader]  # the memory-mapped file, or None for an in-memory state dict
    model_state: object  # `model_pieces` of the model
    sources: dict[str, str]  # model tensor name -> key in the state dict
    missing: list[str]  # model tensors the state dict lacks


def _plan_dense_load(module, state_dict, source: str, strict: bool, tp_rank: int, tp_size: int) -> _DenseLoadPlan:
    """Match the state dict's names and global shapes to the model's pieces; modifies nothing."""
    reader = SafetensorsReader(state_dict) if isinstance(state_dict, (str, os.PathLike)) else None
    try:
        keys = set(reader.header) if reader is not None else set(state_dict)
        # A file written by `export_dense` stores a tied tensor once; an untied model takes it under
        # each of its names.
        tied = json.loads(reader.metadata.get("tied", "{}")) if reader is not None else {}
        model_state = model_pieces(module, tp_rank, tp_size)
        sources, missing = {}, []
        for name, piece in model_state.pieces.items():
            names = [name, *[a for a, t in model_state.aliases.items() if t == name]]
            found = [n for n in [*names, *[tied.get(n) for n in names]] if n in keys]
            if not found:
                missing.append(name)
                continue
            shape = reader.describe(found[0])[1] if reader is not None else tuple(state_dict[found[0]].shape)
            if tuple(shape) != piece.global_shape:
                raise CheckpointError(
                    f"{source}: tensor {found[0]!r} has shape {list(shape)}, the model needs the global shape "
                    f"{list(piece.global_shape)}"
                )
            sources[name] = found[0]
        unexpected = sorted(keys - set(model_state.pieces) - set(model_state.aliases))
        if strict and (missing or unexpected):
            raise CheckpointError(f"{source} does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    return _DenseLoadPlan(reader, model_state, sources, missing)


def _check_masters_reachable(module, engine, adapter) -> None:
    """A DeepSpeedEngine alone cannot reach the fp32 masters of world-sharded bf16/fp16 parameters
    (bigdense's `WorldShardedAdamW` holds them, not DeepSpeed): refuse rather than leave them stale."""
    if engine is None or isinstance(adapter, SplitOptimizerState):
        return
    stale = [n for n, p in module.named_parameters() if is_world_sharded(p) and p.dtype != torch.float32]
    if stale:
        raise TypeError(
            f"load_dense_state_dict: the DeepSpeedEngine's world-sharded {stale[0]!r} ({len(stale)} such "
            f"parameters) keeps its fp32 master in bigdense's DSEngine, not in DeepSpeed's optimizer; pass "
            f"the bigdense engine (bd.build_engine's), not its .ds"
        )


def _apply_dense_load(plan: _DenseLoadPlan, state_dict, adapter) -> None:
    """Copy each rank's slice into its parameters, closing the file; derived optimizer state
    (DeepSpeed's fp32 masters) follows the weights."""
    try:
        with torch.no_grad():
            for name, key in plan.sources.items():
                full = plan.reader.view(key) if plan.reader is not None else state_dict[key]
                for box in plan.model_state.pieces[name].boxes():
                    box.tensor.copy_(narrow_box(full, [0] * full.dim(), box.offsets, box.shape))
    finally:
        if plan.reader is not None:
            plan.reader.close()
    if adapter is not None:
        adapter.load(plan.model_state, None, {})
