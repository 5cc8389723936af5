"""`load_hf_weights`: the weights of a Hugging Face ``save_pretrained`` directory into a model
converted by `bd.parallelize`, each rank reading only its own slices.

The safetensors files are memory-mapped (`SafetensorsReader`); a rank copies the boxes of each
global tensor it holds (`model_pieces`, from the layers' shard specs), so it touches only those
pages, and drops those pages before the next tensor: a tensor split over TP costs each rank its
share, and at most one tensor's file pages are resident at a time. Names follow transformers' own rules from
checkpoint keys to model parameters (``get_model_conversion_mapping``: renamings, and converters
such as the per-expert ``experts.0.w1.weight`` of a Mixtral checkpoint merged into the model's
fused ``experts.gate_up_proj``). A converted tensor is built whole from its sources before the
rank takes its box, so the most a rank holds beyond its shards is the largest such tensor.
"""
from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ._agree import agree
from .boxes import narrow_box
from .format import CheckpointError, SafetensorsReader
from .pieces import current_context, model_pieces

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFWeightFiles:
    """The safetensors files of a ``save_pretrained`` directory: one ``model.safetensors``, or
    several named by ``model.safetensors.index.json``'s weight map. Opened lazily, closed together."""

    def __init__(self, directory):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE).exists():
            with SafetensorsReader(self.directory / SINGLE) as reader:
                weight_map = {name: SINGLE for name in reader.header}
        else:
            found = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            raise CheckpointError(
                f"{self.directory}: no {SINGLE} or {INDEX} (what save_pretrained writes with safetensors); found "
                f"{found[:8]}. A PyTorch .bin checkpoint: load it in transformers and save_pretrained it again")
        self.weight_map: dict[str, str] = weight_map
        self._readers: dict[str, SafetensorsReader] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def reader(self, key: str) -> SafetensorsReader:
        file = self.weight_map[key]
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(self.directory / file)
        return self._readers[file]

    def view(self, key: str) -> torch.Tensor:
        """The stored tensor over the mapped file: nothing is read until it is sliced and copied."""
        return self.reader(key).view(key)

    def release(self, key: str) -> None:
        """Drop the file pages reading ``key`` brought in (`SafetensorsReader.release`)."""
        self.reader(key).release(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader(key).describe(key)[1]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


@dataclass
class Source:
    """Where one model tensor comes from: a stored tensor under ``keys[0]``, or (``converter`` set)
    transformers' conversion of the stored tensors ``keys``."""

    keys: list[str]
    converter: Optional[object] = None
    patterns: list[str] = field(default_factory=list)  # the converter's source pattern of each key


def checkpoint_sources(hf_model: nn.Module, keys: list[str]) -> dict[str, Source]:
    """``{model tensor name: Source}`` for the stored ``keys``, by transformers' loading rules."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    model_names = dict.fromkeys(hf_model.state_dict(keep_vars=True), True)
    sources: dict[str, Source] = {}
    for key in sorted(keys, key=dot_natural_key):  # experts in index order, as transformers merges them
        target, pattern = rename_source_key(key, renamings, converters, hf_model.base_model_prefix, model_names)
        source = sources.setdefault(target, Source([]))
        source.keys.append(key)
        if pattern is not None:
            source.converter = next(c for c in converters if pattern in c.source_patterns)
            source.patterns.append(pattern)
    return sources


def build_tensor(files: HFWeightFiles, name: str, source: Source, hf_model: nn.Module) -> torch.Tensor:
    """Model tensor ``name``, whole: a view of the stored tensor, or the converter's output."""
    if source.converter is None:
        return files.view(source.keys[0])
    converter = deepcopy(source.converter)
    for key, pattern in zip(source.keys, source.patterns):
        converter.add_tensor(name, key, pattern, _reader_of(files, key))
    built = converter.convert(name, model=hf_model, config=hf_model.config)
    if name not in built:
        raise CheckpointError(f"{files.directory}: transformers' conversion of {source.keys[:2]}... made "
                              f"{sorted(built)}, not the model's {name!r}")
    value = built[name]
    return value[0] if isinstance(value, list) else value


def _reader_of(files: HFWeightFiles, key: str) -> Callable[[], torch.Tensor]:
    return lambda: files.view(key)


@dataclass
class _Plan:
    files: HFWeightFiles
    pieces: object  # `ModelState`
    sources: dict[str, Source]  # model tensor name -> where it comes from
    unused: list[str]  # stored keys no model tensor takes


def load_hf_weights(model: nn.Module, directory) -> list[str]:
    """Copy ``directory``'s weights (a ``save_pretrained`` directory with safetensors files) into
    ``model``: a transformers model, converted by `bd.parallelize` or not, or a `CausalLM` holding
    one. Each rank reads its own boxes of each tensor. Every model tensor must be found (a head
    tied to the input embedding takes the embedding's); stored tensors the model has no place for
    are returned (transformers too ignores them, e.g. a rotary ``inv_freq``).

    Collective when distributed (every rank calls it): names and global shapes are checked and
    agreed on before any parameter changes. Call before an engine takes copies of the weights.
    """
    hf_model = getattr(model, "lm", model)
    ctx = current_context()
    where = f"load_hf_weights({directory})"
    plan = agree(where, lambda: _plan(hf_model, directory, ctx.tp_rank, ctx.tp_size))
    try:
        agree(f"{where}: copying", lambda: _copy(plan, hf_model))
    finally:
        plan.files.close()
    return plan.unused


def _plan(hf_model: nn.Module, directory, tp_rank: int, tp_size: int) -> _Plan:
    """Match the stored tensors to the model's pieces and check the shapes; modifies nothing."""
    files = HFWeightFiles(directory)
    try:
        pieces = model_pieces(hf_model, tp_rank, tp_size)
        found = checkpoint_sources(hf_model, files.keys())
        sources, missing = {}, []
        for name in pieces.pieces:
            names = [name, *[alias for alias, target in pieces.aliases.items() if target == name]]
            source = next((found[n] for n in names if n in found), None)
            if source is None:
                missing.append(name)
                continue
            if source.converter is None and tuple(files.shape(source.keys[0])) != pieces.pieces[name].global_shape:
                raise CheckpointError(
                    f"{directory}: tensor {source.keys[0]!r} has shape {list(files.shape(source.keys[0]))}, the "
                    f"model's {name!r} needs {list(pieces.pieces[name].global_shape)} (config.json of another model?)")
            sources[name] = source
        if missing:
            raise CheckpointError(f"{directory} lacks {len(missing)} of the model's tensors: {missing[:6]} (config.json "
                                  f"of another model, or weights saved without them?)")
        taken = {key for s in sources.values() for key in s.keys}
        unused = sorted(set(files.keys()) - taken)
    except BaseException:
        files.close()
        raise
    return _Plan(files, pieces, sources, unused)


def _copy(plan: _Plan, hf_model: nn.Module) -> None:
    with torch.no_grad():
        for name, source in plan.sources.items():
            piece = plan.pieces.pieces[name]
            full = build_tensor(plan.files, name, source, hf_model)
            if tuple(full.shape) != piece.global_shape:
                raise CheckpointError(f"{plan.files.directory}: {name!r} converts to shape {list(full.shape)}, the "
                                      f"model needs {list(piece.global_shape)}")
            for box in piece.boxes():
                box.tensor.copy_(narrow_box(full, [0] * full.dim(), box.offsets, box.shape))
            # Beyond its shards a rank then holds one tensor at a time: a converted one, or the
            # file pages its slices touched (a row-parallel slice touches every row's pages).
            del full
            for key in source.keys:
                plan.files.release(key)
