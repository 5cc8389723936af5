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

A LoRA checkpoint is written by `bigdense.checkpoint.lora_export`: a PEFT adapter directory, or with
``merge=True`` the base with the adapters folded in.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from ..models.hf_dir import CONFIG
from .dense import CheckpointTensors
from .format import CheckpointError, read_manifest, resolve_checkpoint
from .hf_files import (
    LM_PREFIX, OutTensor, check_out, copy_hf_files, hf_files_dir, meta_model_of, parse_size, publish, split_files,
    write_weights, written_float_dtype,
)
from .lora_export import adapter_writer, merged_writer


def export_hf(source, out, *, max_shard_size: Union[str, int] = "5GB", dtype: Optional[torch.dtype] = None,
              verify: bool = True, merge: bool = False) -> Path:
    """Write the `CausalLM` of checkpoint ``source`` (a run directory, its ``checkpoints/`` or
    ``latest``, or a checkpoint directory) as a Hugging Face directory ``out``; returns ``out``.

    ``max_shard_size``: the most bytes of tensors per file (``"500MB"``, ``"5GB"`` or an int; a
    tensor larger than that goes alone in its file). ``dtype`` casts floating-point tensors (e.g.
    ``torch.bfloat16``) and is recorded in config.json; without it the stored dtype is written.
    ``verify``: check each shard's checksum as it is read. ``out`` must not exist or be empty; a
    failed export leaves nothing there. Raises `CheckpointError` for a checkpoint that is no
    `CausalLM`, has no config.json to be found, or does not match that config.

    A LoRA checkpoint is written as a PEFT adapter directory, or with ``merge=True`` as its base
    with the adapters folded in (see the module docstring; ``verify`` then also checks the base
    directory's weights against the digest the manifest records). ``dtype`` casts the factors, or
    the merged tensors.
    """
    limit = parse_size(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"export_hf: dtype must be a floating-point torch.dtype, got {dtype!r}")
    out = Path(out)
    check_out(out)
    ckpt = resolve_checkpoint(source)
    manifest = read_manifest(ckpt)
    lora = manifest.get("lora")
    if merge and not lora:
        raise CheckpointError(f"{ckpt} holds no adapters (a full checkpoint): merging is for a LoRA checkpoint; "
                              f"export it without merge")
    with CheckpointTensors(ckpt, manifest, verify=verify) as stored:
        _check_causal_lm(stored, ckpt)
        if lora:
            publish(out, merged_writer(ckpt, manifest, lora, stored, dtype, limit, verify) if merge
                     else adapter_writer(ckpt, manifest, lora, stored, dtype))
            return out
        hf_dir = hf_files_dir(ckpt, manifest)
        meta_model = meta_model_of(hf_dir)
        outputs = plan_outputs(meta_model, stored, dtype, f"{ckpt} against {hf_dir / CONFIG}")

        def write(directory: Path) -> None:
            write_weights(directory, split_files(outputs, limit), _Reverter(meta_model, stored, dtype).take)
            copy_hf_files(hf_dir, directory, written_float_dtype(outputs))

        publish(out, write)
    return out


def _check_causal_lm(stored: CheckpointTensors, ckpt: Path) -> None:
    others = sorted(n for n in stored.names if not n.startswith(LM_PREFIX))
    if others or not stored.names:
        raise CheckpointError(f"{ckpt} is not a checkpoint of a bigdense.models.CausalLM (expected only "
                              f"'{LM_PREFIX}...' model tensors, found {others[:4] or 'none'}); "
                              f"bd.export_dense exports other models")


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

