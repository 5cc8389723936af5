"""A LoRA checkpoint (`bigdense.checkpoint.lora_state`: adapters only, the frozen base named in its
manifest) is written as a PEFT adapter directory (`bigdense.checkpoint.peft.write_peft_adapter`:
``adapter_config.json`` with ``base_model_name_or_path`` the recorded base, and
``adapter_model.safetensors`` of the full factors under their transformers names), beside the base
directory's tokenizer and generation config; ``PeftModel.from_pretrained(base_model, out)`` loads
it. With ``merge=True`` it is written instead as the base with each adapter folded in, ``W + scaling
* B @ A`` (transposed for a ``Conv1D``'s (in, out) layout), in fp32 and then cast: a plain directory
``from_pretrained`` loads. The base's tensors come from the base directory the manifest records
(checked against its digest), one tensor at a time, under the names that directory stores them by.

Both are `bigdense.checkpoint.hf_export.export_hf`'s for a LoRA checkpoint; what writes a directory
is shared with it (`bigdense.checkpoint.hf_files`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..layers.conv1d import is_conv1d
from ..layers.lora import LoRASettings, adapted_kind, is_lora_name
from ..models.hf_dir import CONFIG
from .dense import CheckpointTensors
from .format import CheckpointError, CheckpointMismatch
from .hf_files import LM_PREFIX, OutTensor, copy_hf_files, hf_files_dir, meta_model_of, split_files, write_weights, \
    written_float_dtype
from .hf_import import HFWeightFiles, checkpoint_sources
from .lora_state import as_base, hf_base, hf_weight_files, layer_settings
from .peft import short_targets, write_peft_adapter


def _base_dir(ckpt: Path, manifest: dict, lora: dict) -> Path:
    """The base directory of a LoRA checkpoint, with its weights: the one its ``lora`` record
    names, else the config's ``model.path``."""
    base = as_base(lora.get("base"))
    model_path = ((manifest.get("config") or {}).get("model") or {}).get("path")
    places = [Path(base.path)] if base is not None and not base.path.startswith("seed:") else []
    places += [Path(model_path)] if model_path else []
    for place in places:
        if (place / CONFIG).is_file() and hf_weight_files(place):
            return place
    raise CheckpointError(f"{ckpt} is a LoRA checkpoint: its base is {base.describe() if base else 'not named'}, "
                          f"but no Hugging Face directory with {CONFIG} and weights is at "
                          f"{[str(p) for p in places] or 'any recorded path'}; the base is needed to merge")


def _layer_names(lora: dict) -> list[str]:
    """The adapted layers, as transformers names them (``lm.`` stripped)."""
    return [name[len(LM_PREFIX):] for name in lora["layers"]]


def adapter_writer(ckpt: Path, manifest: dict, lora: dict, stored: CheckpointTensors,
                    dtype: Optional[torch.dtype]) -> Callable[[Path], None]:
    """What writes a LoRA checkpoint as a PEFT adapter directory, after checking it against the
    model of the base's config.json."""
    others = sorted(n for n in stored.names if not is_lora_name(n))
    if others:
        raise CheckpointError(f"{ckpt} holds trained tensors besides the adapters ({others[:4]}, {len(others)} in "
                              f"all), which a PEFT adapter directory would leave out: export with merge "
                              f"(--merge) to write them with the base")
    if lora.get("overrides"):
        raise CheckpointError(f"{ckpt}: the adapters of {sorted(lora['overrides'])[:3]} have other settings than "
                              f"the rest; a PEFT adapter config has one r, alpha, dropout and rsLoRA: export with "
                              f"merge (--merge)")
    try:
        hf_dir = hf_files_dir(ckpt, manifest)
    except CheckpointError:
        hf_dir = _base_dir(ckpt, manifest, lora)
    meta_model = meta_model_of(hf_dir)
    layers = _layer_names(lora)
    for layer in layers:
        _check_factors(meta_model, layer, stored, lora, f"{ckpt} against {hf_dir / CONFIG}")
    base = as_base(lora.get("base"))
    alpha = lora["alpha"]
    config = {"r": int(lora["r"]), "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
              "lora_dropout": lora["dropout"], "use_rslora": bool(lora["rslora"]),
              "target_modules": short_targets(meta_model, layers),
              "fan_in_fan_out": any(is_conv1d(meta_model.get_submodule(n)) for n in layers),
              "base_model_name_or_path": base.path if base is not None else str(hf_dir)}

    def write(directory: Path) -> None:
        factors = {name[len(LM_PREFIX):]: stored.assemble(name, dtype) for name in stored.names}
        copy_hf_files(hf_dir, directory, None, with_config=False)  # the tokenizer and generation config
        write_peft_adapter(directory, factors, config)

    return write


def _check_factors(meta_model, layer: str, stored: CheckpointTensors, lora: dict, where: str) -> None:
    """``layer`` is a linear layer of the model, and its stored factors have its shapes."""
    try:
        module = meta_model.get_submodule(layer)
    except AttributeError:
        raise CheckpointError(f"{where}: the adapted layer {layer!r} is not in the model") from None
    kind = adapted_kind(module)
    if kind is None:
        raise CheckpointError(f"{where}: the adapted layer {layer!r} is a {type(module).__name__}, not a linear layer")
    r = layer_settings(lora)[LM_PREFIX + layer]["r"]
    for factor, shape in (("lora_A", [r, kind.in_features]), ("lora_B", [kind.out_features, r])):
        name = f"{LM_PREFIX}{layer}.{factor}.weight"
        if name not in stored.names:
            raise CheckpointError(f"{where}: {name!r} is missing from the checkpoint")
        if list(stored.shape(name)) != shape:
            raise CheckpointError(f"{where}: {name!r} has shape {list(stored.shape(name))}, expected {shape}")


@dataclass
class _Fold:
    """How one tensor of the base directory changes: ``layer``'s adapter folded in (``scaling``,
    ``conv1d``: the base stores the weight (in, out)), or replaced by the checkpoint's ``stored``."""

    layer: Optional[str] = None
    scaling: float = 1.0
    conv1d: bool = False
    stored: Optional[str] = None


def merged_writer(ckpt: Path, manifest: dict, lora: dict, stored: CheckpointTensors, dtype: Optional[torch.dtype],
                   limit: int, verify: bool) -> Callable[[Path], None]:
    """What writes a LoRA checkpoint's base with its adapters folded in, as a Hugging Face
    directory: every tensor of the base directory under its stored name, the adapted weights
    ``W + scaling * B @ A`` (computed in fp32), any other trained tensor the checkpoint holds in
    place of the base's."""
    base_dir = _base_dir(ckpt, manifest, lora)
    recorded = as_base(lora.get("base"))
    if verify and recorded is not None:
        found = hf_base(base_dir)
        if found.digest != recorded.digest:
            raise CheckpointMismatch(f"{ckpt}: its adapters were trained on the base {recorded.describe()}, but "
                                     f"{base_dir} now holds other weights ({found.digest}); merging them would "
                                     f"not give the trained model")
    meta_model = meta_model_of(base_dir)
    files = HFWeightFiles(base_dir)
    try:
        folds, outputs = _plan_merge(meta_model, files, stored, lora, dtype, f"{ckpt} against {base_dir}")
    except BaseException:
        files.close()
        raise

    def take(tensor: OutTensor) -> torch.Tensor:
        fold = folds.get(tensor.name)
        if fold is not None and fold.stored is not None:
            return stored.assemble(fold.stored).to(tensor.dtype)
        weight = files.view(tensor.name)
        if fold is None:
            value = weight.to(tensor.dtype, copy=True)
        else:
            a = stored.assemble(f"{LM_PREFIX}{fold.layer}.lora_A.weight", torch.float32)
            b = stored.assemble(f"{LM_PREFIX}{fold.layer}.lora_B.weight", torch.float32)
            delta = (b @ a) * fold.scaling
            value = (weight.float() + (delta.t() if fold.conv1d else delta)).to(tensor.dtype)
        files.release(tensor.name)
        return value

    def write(directory: Path) -> None:
        try:
            write_weights(directory, split_files(outputs, limit), take)
        finally:
            files.close()
        copy_hf_files(base_dir, directory, written_float_dtype(outputs))

    return write


def _plan_merge(meta_model, files: HFWeightFiles, stored: CheckpointTensors, lora: dict, dtype: Optional[torch.dtype],
                where: str) -> tuple[dict[str, _Fold], list[OutTensor]]:
    """``({base key: its fold}, every output tensor)`` of a merge, checked against the model."""
    sources = checkpoint_sources(meta_model, files.keys())
    folds: dict[str, _Fold] = {}
    settings = layer_settings(lora)
    for layer in _layer_names(lora):
        _check_factors(meta_model, layer, stored, lora, where)
        key = _base_key(sources, f"{layer}.weight", where)
        scaling = LoRASettings(**settings[LM_PREFIX + layer]).scaling
        folds[key] = _Fold(layer=layer, scaling=scaling, conv1d=is_conv1d(meta_model.get_submodule(layer)))
    for name in (n for n in stored.names if not is_lora_name(n)):
        key = _base_key(sources, name[len(LM_PREFIX):], where)
        if list(files.shape(key)) != list(stored.shape(name)):
            raise CheckpointError(f"{where}: {name!r} has shape {list(stored.shape(name))}, the base's {key!r} "
                                  f"{list(files.shape(key))}")
        folds[key] = _Fold(stored=name)

    def out_dtype(key: str) -> torch.dtype:
        stored_dtype = files.reader(key).describe(key)[0]
        return dtype if dtype is not None and stored_dtype.is_floating_point else stored_dtype

    outputs = [OutTensor(key, out_dtype(key), tuple(files.shape(key)), key, key) for key in files.keys()]
    return folds, outputs


def _base_key(sources: dict, name: str, where: str) -> str:
    """The base directory's key of model tensor ``name``, stored whole under one name."""
    source = sources.get(name)
    if source is None:
        raise CheckpointError(f"{where}: the base directory stores no tensor {name!r} of its own (a tied weight?); "
                              f"merging cannot fold an adapter into it")
    if source.converter is not None or len(source.keys) != 1:
        raise CheckpointError(f"{where}: the base directory stores {name!r} as {source.keys[:3]}, converted by "
                              f"transformers on loading; merging folds adapters only into weights stored whole")
    return source.keys[0]

