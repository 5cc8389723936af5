"""Writing a Hugging Face directory whole: its weight files (safetensors of at most a given size,
with their index), the config and tokenizer files copied beside them, all under a hidden temporary
name renamed into place when complete (`publish`). Shared by `bigdense.checkpoint.hf_export` (a
full checkpoint) and `bigdense.checkpoint.lora_export` (a LoRA checkpoint, merged or as an adapter).
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
from .format import RUN_CHECKPOINTS, CheckpointError, write_safetensors
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


def publish(out: Path, write: Callable[[Path], None]) -> None:
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


def check_out(out: Path) -> None:
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


def meta_model_of(hf_dir: Path):
    """The transformers model of ``hf_dir``'s config.json, on the meta device (no weights, no network)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


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


def write_weights(directory: Path, files: list[list[OutTensor]], take: Callable[[OutTensor], torch.Tensor]) -> None:
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


def written_float_dtype(outputs: list[OutTensor]) -> Optional[torch.dtype]:
    """The dtype of most floating-point bytes written (what config.json's ``dtype`` says)."""
    counts = Counter()
    for t in outputs:
        if t.dtype.is_floating_point:
            counts[t.dtype] += t.nbytes
    return counts.most_common(1)[0][0] if counts else None


def copy_hf_files(hf_dir: Path, directory: Path, dtype: Optional[torch.dtype], with_config: bool = True) -> None:
    """config.json (its ``dtype`` set to the written one; not with ``with_config=False``) and every
    other file of ``hf_dir`` that is not weights: generation config, tokenizer files."""
    for path in sorted(hf_dir.iterdir()):
        if path.is_file() and path.name != CONFIG and not path.name.startswith(".") \
                and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(path, directory / path.name)
    if not with_config:
        return
    config = json.loads((hf_dir / CONFIG).read_text())
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:  # older transformers' name for it; kept in step
            config["torch_dtype"] = name
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

