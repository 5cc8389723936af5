"""`export_hf`: a checkpoint of a Hugging Face causal LM trained by bigdense, back to a directory
transformers' ``from_pretrained`` loads.

    bd.export_hf("runs/x", "exported")                  # the run's latest checkpoint
    AutoModelForCausalLM.from_pretrained("exported")

The checkpoint holds a `bigdense.models.CausalLM`: tensors ``lm.<name>`` in transformers'
in-memory naming. The directory holds what ``save_pretrained`` writes: ``lm.`` stripped,
transformers' weight conversions reverted (a MoE's fused ``experts.gate_up_proj`` back to the
per-expert tensors its checkpoints name), a tied weight once, safetensors files of at most
``max_shard_size`` (``model.safetensors``, or ``model-00001-of-0000K.safetensors`` and
``model.safetensors.index.json``), and the source directory's config, generation config and
tokenizer files, found where the training job copied them (``RUN/hf/``) or at the config's
``model.path``.

The transformers model is built on the meta device, only for its names, shapes and conversions.
Tensors are assembled from the shard files one at a time (`CheckpointTensors`), converted, written
and dropped: the process holds about one global tensor of the checkpoint at a time, never a file's
worth, let alone the model. The directory is
built under a hidden temporary name and renamed into place whole. transformers is imported only
by the functions that need it.
"""
from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ..durable import fsync_tree, hidden_sibling, rename_into_place
from ..models.hf_dir import CONFIG, WEIGHT_SUFFIXES
from .dense import CheckpointTensors
from .format import RUN_CHECKPOINTS, CheckpointError, read_manifest, resolve_checkpoint, write_safetensors
from .hf_import import INDEX, SINGLE

RUN_HF = "hf"  # <run_dir>/hf/: where the training job copies the source directory's config and tokenizer
LM_PREFIX = "lm."  # `CausalLM` holds the transformers model as ``lm``
# Decimal units as transformers' max_shard_size reads them ("5GB" is 5 * 10**9 bytes), binary with "iB".
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass
class OutTensor:
    """One tensor of the exported files, and the checkpoint tensor it comes from."""

    name: str  # the name in the files (transformers' checkpoint naming)
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str  # the model tensor (transformers' in-memory name) whose reverted conversion yields it
    stored: str  # the checkpoint's name of that tensor (``lm.``..., the stored one when tied)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def export_hf(source, out, *, max_shard_size: Union[str, int] = "5GB", dtype: Optional[torch.dtype] = None,
              verify: bool = True) -> Path:
    """Write the `CausalLM` of checkpoint ``source`` (a run directory, its ``checkpoints/`` or
    ``latest``, or a checkpoint directory) as a Hugging Face directory ``out``; returns ``out``.

    ``max_shard_size``: the most bytes of tensors per file (``"500MB"``, ``"5GB"`` or an int; a
    tensor larger than that goes alone in its file). ``dtype`` casts floating-point tensors (e.g.
    ``torch.bfloat16``) and is recorded in config.json; without it the stored dtype is written.
    ``verify``: check each shard's checksum as it is read. ``out`` must not exist or be empty; a
    failed export leaves nothing there. Raises `CheckpointError` for a checkpoint that is no
    `CausalLM`, has no config.json to be found, or does not match that config.
    """
    limit = parse_size(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"export_hf: dtype must be a floating-point torch.dtype, got {dtype!r}")
    out = Path(out)
    _check_out(out)
    ckpt = resolve_checkpoint(source)
    manifest = read_manifest(ckpt)
    with CheckpointTensors(ckpt, manifest, verify=verify) as stored:
        _check_causal_lm(stored, ckpt)
        hf_dir = hf_files_dir(ckpt, manifest)
        meta_model = _meta_model(hf_dir)
        outputs = plan_outputs(meta_model, stored, dtype, f"{ckpt} against {hf_dir / CONFIG}")

        def write(directory: Path) -> None:
            _write_weights(directory, split_files(outputs, limit), _Reverter(meta_model, stored, dtype).take)
            _copy_hf_files(hf_dir, directory, _written_float_dtype(outputs))

        _publish(out, write)
    return out


def _publish(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a hidden sibling of ``out``, renamed into place when complete: a failure
    leaves nothing at ``out`` (and removes the sibling)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(out, "tmp")
    tmp.mkdir()
    try:
        write(tmp)
        fsync_tree(tmp)
        rename_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_size(size: Union[str, int]) -> int:
    """Bytes of ``size``: an int, or a string such as ``"500MB"``, ``"5GB"``, ``"2GiB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*", str(size).lower())
        if match is None or (match.group(2) or "") not in _UNITS:
            raise ValueError(f"max_shard_size must be a number of bytes or a size like '500MB' or '5GB', got {size!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not an empty directory; export_hf writes a new "
                              f"directory (remove it, or give another path)")


def hf_files_dir(ckpt: Path, manifest: dict) -> Path:
    """The directory holding the model's config.json and tokenizer: the run's ``hf/`` (the training
    job copies them there from ``model.path``), else ``model.path`` of the checkpoint's config."""
    run_hf = ckpt.parent.parent / RUN_HF if ckpt.parent.name == RUN_CHECKPOINTS else None
    model_path = ((manifest.get("config") or {}).get("model") or {}).get("path")
    for place in (run_hf, Path(model_path) if model_path else None):
        if place is not None and (place / CONFIG).is_file():
            return place
    in_run = f"{run_hf}" if run_hf else f"no run's {RUN_HF}/ ({ckpt} is not in a run's {RUN_CHECKPOINTS}/)"
    recorded = f"{model_path}" if model_path else "no model.path (the checkpoint records none)"
    raise CheckpointError(f"{ckpt}: found no {CONFIG} of the Hugging Face model; looked in {in_run} and in "
                          f"{recorded}")


def _check_causal_lm(stored: CheckpointTensors, ckpt: Path) -> None:
    others = sorted(n for n in stored.names if not n.startswith(LM_PREFIX))
    if others or not stored.names:
        raise CheckpointError(f"{ckpt} is not a checkpoint of a bigdense.models.CausalLM (expected only "
                              f"'{LM_PREFIX}...' model tensors, found {others[:4] or 'none'}); "
                              f"bd.export_dense exports other models")


def _meta_model(hf_dir: Path):
    """The transformers model of ``hf_dir``'s config.json, on the meta device (no weights, no network)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def plan_outputs(meta_model, stored: CheckpointTensors, dtype: Optional[torch.dtype], where: str) -> list[OutTensor]:
    """Every tensor the files will hold, in the model's order, each with the checkpoint tensor it
    comes from; checks the checkpoint against the model of config.json first."""
    expected = {n: tuple(t.shape) for n, t in meta_model.state_dict().items()
                if n not in (meta_model._keys_to_ignore_on_save or [])}
    written = _names_to_write(meta_model, stored)
    _check_against_model(expected, written, stored, where)
    per_tensor = {}
    outputs = []
    for name in (n for n in expected if n in written):
        key = written[name]
        template = torch.empty(stored.shape(key), dtype=stored.out_dtype(key, dtype), device="meta")
        reverted = _revert(meta_model, {name: template})
        per_tensor.update(reverted)
        outputs += [OutTensor(n, t.dtype, tuple(t.shape), name, key) for n, t in reverted.items()]
    _check_revert_per_tensor(meta_model, written, stored, dtype, per_tensor, where)
    return outputs


def _names_to_write(meta_model, stored: CheckpointTensors) -> dict[str, str]:
    """``{transformers name: stored name}``: every stored tensor under its own name and its aliases'
    (stripped of ``lm.``), except names that transformers ties to another (as ``save_pretrained``
    writes a tied weight once, under the name it ties the others to)."""
    tied_targets = set(getattr(meta_model, "all_tied_weights_keys", None) or {})
    written = {}
    for key in stored.names:
        group = [key, *sorted(a for a, target in stored.aliases.items() if target == key)]
        names = [n[len(LM_PREFIX):] for n in group]
        for name in [n for n in names if n not in tied_targets] or names[:1]:
            written[name] = key
    return written


def _check_against_model(expected: dict, written: dict, stored: CheckpointTensors, where: str) -> None:
    held = {n[len(LM_PREFIX):] for n in [*stored.names, *stored.aliases]}
    missing, unexpected = sorted(set(expected) - held), sorted(held - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: the checkpoint is not of this model: it lacks {missing[:4]} "
                              f"({len(missing)}) and has no place for {unexpected[:4]} ({len(unexpected)})")
    for name, key in written.items():
        if tuple(stored.shape(key)) != expected[name]:
            raise CheckpointError(f"{where}: {key!r} has shape {list(stored.shape(key))}, the model of the config "
                                  f"has {name!r} of shape {list(expected[name])}")


def _revert(meta_model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' conversions of the model tensors ``tensors`` reverted, as ``save_pretrained``
    reverts them: ``{checkpoint name: tensor}``."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(meta_model, tensors)
    return {n: t[0] if isinstance(t, list) else t for n, t in reverted.items()}


def _check_revert_per_tensor(meta_model, written, stored, dtype, per_tensor: dict, where: str) -> None:
    """Reverting one tensor at a time must give what reverting the whole state dict gives (what
    ``save_pretrained`` does); a conversion that needs several model tensors together does not."""
    whole = _revert(meta_model, {name: torch.empty(stored.shape(key), dtype=stored.out_dtype(key, dtype), device="meta")
                                 for name, key in written.items()})
    shapes = {n: tuple(t.shape) for n, t in whole.items()}
    if shapes != {n: tuple(t.shape) for n, t in per_tensor.items()}:
        differ = sorted(set(shapes) ^ set(per_tensor))[:4]
        raise CheckpointError(f"{where}: transformers' weight conversions of {type(meta_model).__name__} combine "
                              f"several tensors, which export_hf reverts one tensor at a time (names that "
                              f"differ: {differ})")


def split_files(outputs: list[OutTensor], limit: int) -> list[list[OutTensor]]:
    """``outputs`` in order, cut into files of at most ``limit`` bytes of tensors (a larger tensor
    alone in its file)."""
    files: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in outputs:
        if files[-1] and size + tensor.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += tensor.nbytes
    return files


class _Reverter:
    """Each output tensor when its turn comes: the model tensor it comes from is assembled from the
    checkpoint and reverted when its first output is asked for, and let go with its last."""

    def __init__(self, meta_model, stored: CheckpointTensors, dtype: Optional[torch.dtype]):
        self.meta_model, self.stored, self.dtype = meta_model, stored, dtype
        self._pending: dict[str, torch.Tensor] = {}

    def take(self, tensor: OutTensor) -> torch.Tensor:
        if tensor.name not in self._pending:
            self._pending = {}  # let the previous model tensor go before assembling the next
            self._pending = _revert(self.meta_model, {tensor.source: self.stored.assemble(tensor.stored, self.dtype)})
            if tensor.name not in self._pending:
                raise CheckpointError(f"reverting {tensor.source!r} gave {sorted(self._pending)[:4]}, not "
                                      f"{tensor.name!r} as planned")
        return self._pending.pop(tensor.name)


def _write_weights(directory: Path, files: list[list[OutTensor]], take: Callable[[OutTensor], torch.Tensor]) -> None:
    """The safetensors files (and the index when there are several), one tensor in memory at a time."""
    names = [SINGLE] if len(files) == 1 else [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                              for i in range(1, len(files) + 1)]
    for file_name, tensors in zip(names, files):
        by_name = {t.name: t for t in tensors}
        write_safetensors(directory / file_name, [(t.name, t.dtype, t.shape) for t in tensors],
                          lambda name: take(by_name[name]), {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for f in files for t in f)},
                 "weight_map": {t.name: file_name for file_name, f in zip(names, files) for t in f}}
        (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _written_float_dtype(outputs: list[OutTensor]) -> Optional[torch.dtype]:
    """The dtype of most floating-point bytes written (what config.json's ``dtype`` says)."""
    counts = Counter()
    for t in outputs:
        if t.dtype.is_floating_point:
            counts[t.dtype] += t.nbytes
    return counts.most_common(1)[0][0] if counts else None


def _copy_hf_files(hf_dir: Path, directory: Path, dtype: Optional[torch.dtype]) -> None:
    """config.json (its ``dtype`` set to the written one) and every other file of ``hf_dir`` that is
    not weights: generation config, tokenizer files."""
    for path in sorted(hf_dir.iterdir()):
        if path.is_file() and path.name != CONFIG and not path.name.startswith(".") \
                and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(path, directory / path.name)
    config = json.loads((hf_dir / CONFIG).read_text())
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:  # older transformers' name for it; kept in step
            config["torch_dtype"] = name
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
