"""LoRA adapters in PEFT's format, both ways: a directory ``peft.PeftModel.from_pretrained`` loads.

    bd.add_lora(model, r=8, alpha=16, targets=["q_proj", "v_proj"])   # ... train ...
    bd.save_peft_adapter(model, "out/adapter")          # every rank calls it; global rank 0 writes
    bd.load_peft_adapter(model, "out/adapter")          # at any TP size; adds the adapters if absent

A PEFT adapter directory holds ``adapter_config.json`` (a ``LoraConfig``: ``peft_type "LORA"``,
``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules``, ...) and
``adapter_model.safetensors``: each adapted layer's full factors under
``base_model.model.<name in the Hugging Face model>.lora_A.weight`` (r, in) and ``...lora_B.weight``
(out, r). bigdense names its factors exactly so (`bigdense.layers.lora`), relative to the
transformers model (a `CausalLM`'s ``.lm``), so a key is ``base_model.model.`` + a bigdense
parameter name. Under tensor parallelism a factor may be this rank's slice: saving gathers the full
factors (a collective), loading copies each rank's slice of the full one (`ShardSpec.slice_of`).

Only what bigdense's adapters compute is read: one LoRA adapter per layer with a single ``r`` and
``lora_alpha`` (optionally rsLoRA, dropout). A file asking for more (DoRA, LoRA biases, trained
biases, ``modules_to_save``, per-layer ranks, layer selection, ...) is refused by the option's name
rather than loaded into a model that would compute something else.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from ..durable import fsync_dir, hidden_sibling, rename_into_place, write_bytes_durably
from ..layers.base import copy_full_
from ..layers.conv1d import ColumnParallelConv1D, RowParallelConv1D, is_conv1d
from ..layers.lora import (
    ALL_LINEAR, LoRASettings, adapted_kind, adapted_layers, add_lora, has_lora, lora_settings, lora_targets,
)
from ._agree import agree, world_rank
from .format import CheckpointError, CheckpointMismatch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"  # PEFT's format before safetensors (read only)
KEY_PREFIX = "base_model.model."  # PEFT's prefix of the transformers model's names in the file
FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

# LoraConfig fields bigdense reads (the rest of a written config is PEFT's defaults).
_READ = ("peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules")
# Fields that do not change what a loaded adapter computes: metadata, and how PEFT initialised it.
_INERT = ("base_model_name_or_path", "revision", "task_type", "inference_mode", "init_lora_weights",
          "fan_in_fan_out", "peft_version", "auto_mapping", "megatron_core", "qalora_group_size", "loftq_config",
          "corda_config", "eva_config", "lora_ga_config", "ensure_weight_tying")
# Any other field must be unset (null, false, {} or []), and ``bias`` "none": else the file asks for
# something bigdense's adapters do not compute. These say what each common one is.
_WHY = {
    "use_dora": "DoRA (weight-decomposed LoRA, a magnitude vector per layer)",
    "lora_bias": "a trained bias on lora_B",
    "bias": "trained biases of the base layers",
    "modules_to_save": "fully trained copies of whole modules",
    "rank_pattern": "per-layer ranks",
    "alpha_pattern": "per-layer alphas",
    "layers_to_transform": "adapting only some layer indices",
    "layers_pattern": "adapting only some layer indices",
    "exclude_modules": "excluding modules from target_modules",
    "layer_replication": "replicated layers",
    "target_parameters": "adapters on parameters (not modules)",
    "trainable_token_indices": "trained token embeddings",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA",
    "megatron_config": "Megatron-LM parallel layers",
}


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model PEFT's names are relative to: a `CausalLM`'s ``.lm`` (recognised by
    its interface: a child ``lm`` and no Hugging Face ``config`` of its own), else ``model``."""
    lm = getattr(model, "lm", None)
    return lm if isinstance(lm, nn.Module) and getattr(model, "config", None) is None else model


# ---- the files ----
def write_peft_adapter(directory, factors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write a PEFT LoRA adapter directory; returns its path.

    ``factors``: ``{name relative to the transformers model: full tensor}``, each name ending in
    ``.lora_A.weight`` (r, in) or ``.lora_B.weight`` (out, r), every layer with both. ``config``:
    ``r`` and ``lora_alpha`` (required), and optionally ``lora_dropout``, ``use_rslora``,
    ``target_modules`` (default: the adapted modules' last name parts), ``fan_in_fan_out``,
    ``base_model_name_or_path`` and any other LoraConfig field to write as given. Writes
    ``adapter_config.json`` and ``adapter_model.safetensors`` (contiguous CPU tensors under
    ``base_model.model.<name>``): a new directory appears whole (built hidden, renamed into place);
    in an existing one each file is replaced atomically, the weights first.
    """
    directory = Path(directory)
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise CheckpointError(f"write_peft_adapter({directory}): config needs {key!r}, got keys {sorted(config)}")
    layers = _factor_layers(factors, f"write_peft_adapter({directory})")
    for layer in layers:
        a, b = factors[layer + ".lora_A.weight"], factors[layer + ".lora_B.weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config["r"] or b.shape[1] != config["r"]:
            raise CheckpointError(f"write_peft_adapter({directory}): {layer}: expected lora_A (r, in) and lora_B "
                                  f"(out, r) with r={config['r']}, got {tuple(a.shape)} and {tuple(b.shape)}")
    written = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(config["r"]), "lora_alpha": config["lora_alpha"],
        "lora_dropout": 0.0, "use_rslora": False,
        "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in layers}),
        "bias": "none", "modules_to_save": None, "base_model_name_or_path": None, "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "use_dora": False, "lora_bias": False,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "exclude_modules": None, "revision": None,
    }
    written.update(config)
    tensors = {KEY_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in factors.items()}
    from safetensors.torch import save as safetensors_bytes

    files = [(WEIGHTS_FILE, safetensors_bytes(tensors, metadata={"format": "pt"})),
             (CONFIG_FILE, (json.dumps(written, indent=2, sort_keys=True) + "\n").encode())]
    _publish(directory, files)
    return directory


def _publish(directory: Path, files: list[tuple[str, bytes]]) -> None:
    """Write ``files`` (name, bytes) into ``directory`` so that no reader sees a partial file."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"write_peft_adapter: {directory} exists and is not a directory")
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = hidden_sibling(directory, "peft")
        tmp.mkdir()
        try:
            for name, data in files:
                write_bytes_durably(tmp / name, data)
            fsync_dir(tmp)
            rename_into_place(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return
    for name, data in files:
        tmp = hidden_sibling(directory / name, "tmp")
        try:
            write_bytes_durably(tmp, data)
            os.replace(tmp, directory / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(directory)


def read_peft_adapter(directory) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, {name relative to the transformers model: full tensor})`` of a PEFT LoRA adapter
    directory (``adapter_config.json`` and ``adapter_model.safetensors``, or PEFT's older
    ``adapter_model.bin``). Raises `CheckpointError` naming the file, key or option when a file is
    missing, the adapter is not LoRA, it asks for what bigdense's adapters do not compute (see
    ``_WHY``), or a key is not a LoRA factor."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"read_peft_adapter: {config_path} not found (a PEFT adapter directory holds "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE}, as PeftModel.save_pretrained writes them)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"read_peft_adapter: {config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"read_peft_adapter: {config_path}: expected a JSON object, got {type(config).__name__}")
    check_peft_config(config, str(config_path))
    tensors = _read_weights(directory)
    where = str(directory / (WEIGHTS_FILE if (directory / WEIGHTS_FILE).is_file() else LEGACY_WEIGHTS_FILE))
    factors = {}
    for key, tensor in tensors.items():
        name = key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else key
        if not name.endswith(FACTOR_SUFFIXES):
            what = ("a DoRA magnitude vector" if "lora_magnitude_vector" in name else
                    "an embedding adapter" if "lora_embedding_" in name else "not a LoRA factor")
            raise CheckpointError(f"read_peft_adapter: {where}: key {key!r} is {what}; bigdense loads only "
                                  f"'<module>.lora_A.weight' and '<module>.lora_B.weight' of linear layers")
        factors[name] = tensor
    _factor_layers(factors, f"read_peft_adapter: {where}")
    return config, factors


def check_peft_config(config: dict, where: str) -> None:
    """Refuse a PEFT config that is not a plain LoRA bigdense's adapters compute, naming the option."""
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type is {config.get('peft_type')!r}; bigdense loads only 'LORA' adapters")
    for key in ("r", "lora_alpha", "target_modules"):
        if config.get(key) is None:
            raise CheckpointError(f"{where}: {key!r} is missing; a LoRA adapter config gives r, lora_alpha and "
                                  f"target_modules")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias is {config['bias']!r} ({_WHY['bias']}); bigdense's adapters "
                              f"support only bias 'none'")
    for key, value in config.items():
        if key in _READ or key in _INERT or key == "bias":
            continue
        if value not in (None, False, {}, [], ""):
            what = _WHY.get(key, "an option bigdense's adapters do not implement")
            raise CheckpointError(f"{where}: {key} is {value!r} ({what}); bigdense loads only plain LoRA "
                                  f"adapters ({key} unset)")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    try:
        if path.is_file():
            from safetensors.torch import load_file

            return load_file(str(path))
        legacy = directory / LEGACY_WEIGHTS_FILE
        if legacy.is_file():
            return torch.load(legacy, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is reported by name
        raise CheckpointError(f"read_peft_adapter: {path} could not be read: {type(exc).__name__}: {exc}") from exc
    raise CheckpointError(f"read_peft_adapter: {path} not found (nor PEFT's older {LEGACY_WEIGHTS_FILE}) beside "
                          f"{CONFIG_FILE}")


def _factor_layers(factors: dict[str, Any], where: str) -> list[str]:
    """The layer names of ``factors``'s keys, in order; each layer must have both factors."""
    layers: list[str] = []
    for name in factors:
        if not name.endswith(FACTOR_SUFFIXES):
            raise CheckpointError(f"{where}: {name!r} is not a LoRA factor name ('<module>.lora_A.weight' or "
                                  f"'<module>.lora_B.weight')")
        layer = name[: -len(".lora_A.weight")]
        if layer not in layers:
            layers.append(layer)
    for layer in layers:
        missing = [layer + s for s in FACTOR_SUFFIXES if layer + s not in factors]
        if missing:
            raise CheckpointError(f"{where}: {missing[0]!r} is missing (every adapted layer has lora_A and lora_B)")
    if not layers:
        raise CheckpointError(f"{where}: no LoRA factor in the adapter")
    return layers


def settings_of(config: dict) -> LoRASettings:
    """The `LoRASettings` a PEFT LoRA config describes."""
    return LoRASettings(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0),
                        bool(config.get("use_rslora", False)))


# ---- a model's adapters ----
def short_targets(model: nn.Module, layers: list[str]) -> list[str]:
    """``target_modules`` as PEFT writes them: the adapted modules' last name parts, sorted, when
    those select exactly the adapted modules (PEFT's suffix rule); else the full names."""
    short = sorted({name.rsplit(".", 1)[-1] for name in layers})
    selected = {n for n, m in model.named_modules() if adapted_kind(m) is not None
                and any(n == s or n.endswith("." + s) for s in short)}
    return short if selected == set(layers) else sorted(layers)


def save_peft_adapter(model: nn.Module, directory, base_model_name_or_path: Optional[str] = None) -> Path:
    """Save ``model``'s LoRA adapters as a PEFT adapter directory (`write_peft_adapter`).

    Every rank calls it: the full factors are gathered over TP (a collective), and global rank 0
    writes (any rank when torch.distributed is not initialised); every rank returns once the
    directory is written, and raises if the write failed. ``model``: a `CausalLM` (its ``.lm``) or
    any module holding adapters. ``base_model_name_or_path``: recorded in the config (default: the
    `CausalLM`'s ``pretrained`` directory, else the transformers config's ``_name_or_path``).
    """
    lm = hf_model(model)
    layers = adapted_layers(lm)
    if not layers:
        raise CheckpointError(f"save_peft_adapter: {type(lm).__name__} has no LoRA adapter (call bd.add_lora "
                              f"or bd.load_peft_adapter first)")
    settings = {lora_settings(layer) for layer in layers.values()}
    if len(settings) != 1:
        raise CheckpointError(f"save_peft_adapter: the adapters have different settings {sorted(map(str, settings))}; "
                              f"a PEFT adapter has one r and lora_alpha")
    (s,) = settings
    factors = {}
    for name, layer in layers.items():
        for factor in ("lora_A", "lora_B"):
            factors[f"{name}.{factor}.weight"] = getattr(layer, factor).gather_param("weight").cpu()
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "pretrained", None) or getattr(
            getattr(lm, "config", None), "_name_or_path", None) or None
    conv1d = any(is_conv1d(m) or isinstance(m, (ColumnParallelConv1D, RowParallelConv1D)) for m in layers.values())
    alpha = int(s.alpha) if float(s.alpha).is_integer() else s.alpha  # as PEFT writes it
    config = {"r": s.r, "lora_alpha": alpha, "lora_dropout": s.dropout, "use_rslora": s.rslora,
              "target_modules": short_targets(lm, list(layers)), "fan_in_fan_out": conv1d,
              "base_model_name_or_path": None if base_model_name_or_path is None else str(base_model_name_or_path)}
    directory = Path(directory)
    agree(f"save_peft_adapter({directory})",
          lambda: write_peft_adapter(directory, factors, config) if world_rank() == 0 else None)
    return directory


def _targets_of(lm: nn.Module, target_modules: Union[str, list], where: str) -> list[str]:
    """The module names ``target_modules`` selects by PEFT's rule: a string is ``"all-linear"`` or a
    regular expression a whole name must match; a list names modules or their last name parts."""
    if isinstance(target_modules, str) and target_modules != ALL_LINEAR:
        names = [n for n, _ in lm.named_modules() if n and re.fullmatch(target_modules, n)]
        if not names:
            raise CheckpointMismatch(f"{where}: target_modules {target_modules!r} (a regular expression) matches no "
                                     f"module of {type(lm).__name__}")
        return lora_targets(lm, names)
    try:
        return lora_targets(lm, target_modules)
    except ValueError as exc:
        raise CheckpointMismatch(f"{where}: {exc}") from exc


def load_peft_adapter(model: nn.Module, directory) -> LoRASettings:
    """Load a PEFT LoRA adapter directory into ``model`` (a `CausalLM` or a transformers model,
    converted at any TP size or not); returns the adapter's `LoRASettings`.

    If ``model`` has no adapters yet, they are added (`add_lora`) with the file's ``r``,
    ``lora_alpha``, ``lora_dropout``, ``use_rslora`` and ``target_modules`` (PEFT's matching rule),
    freezing every other parameter; else the existing adapters' settings must be the file's. Each
    rank then copies its slice of every full factor. Every adapted layer must get both factors, and
    every key of the file must name an adapted layer, with the factor's global shape: a mismatch is
    refused by key (expected vs got) before the model is changed, on every rank alike (every rank
    calls this function).
    """
    directory = Path(directory)
    lm = hf_model(model)
    where = f"load_peft_adapter({directory})"

    def plan():
        config, factors = read_peft_adapter(directory)
        settings = settings_of(config)
        if has_lora(lm):
            layers = adapted_layers(lm)
            for name, layer in layers.items():
                if lora_settings(layer) != settings:
                    raise CheckpointMismatch(f"{where}: {name} already has an adapter with {lora_settings(layer)}, "
                                             f"the file's is {settings}")
            shapes = {n: (layer.lora_A.global_shape, layer.lora_B.global_shape) for n, layer in layers.items()}
        else:
            names = _targets_of(lm, config["target_modules"], str(directory / CONFIG_FILE))
            kinds = {n: adapted_kind(lm.get_submodule(n)) for n in names}
            shapes = {n: ((settings.r, k.in_features), (k.out_features, settings.r)) for n, k in kinds.items()}
        for key, tensor in factors.items():
            layer, factor = key.rsplit(".", 2)[:2]
            if layer not in shapes:
                raise CheckpointMismatch(f"{where}: key {KEY_PREFIX + key!r} names no adapted module of "
                                         f"{type(lm).__name__} (adapted: {_few(shapes)}; target_modules "
                                         f"{config['target_modules']!r})")
            expected = shapes[layer][0 if factor == "lora_A" else 1]
            if tuple(tensor.shape) != tuple(expected):
                raise CheckpointMismatch(f"{where}: key {KEY_PREFIX + key!r}: expected shape {tuple(expected)}, "
                                         f"got {tuple(tensor.shape)}")
        missing = [f"{n}.lora_A.weight" for n in shapes if f"{n}.lora_A.weight" not in factors]
        if missing:
            raise CheckpointMismatch(f"{where}: the file has no factors for {len(missing)} adapted module(s) of the "
                                     f"model, first {KEY_PREFIX + missing[0]!r}")
        return settings, list(shapes), factors

    settings, names, factors = agree(where, plan)

    def apply():
        if not has_lora(lm):
            add_lora(lm, r=settings.r, alpha=settings.alpha, targets=names, dropout=settings.dropout,
                     rslora=settings.rslora)
        with torch.no_grad():
            for name in names:
                layer = lm.get_submodule(name)
                for factor in ("lora_A", "lora_B"):
                    key = f"{name}.{factor}.weight"
                    copy_full_(getattr(layer, factor), "weight", factors[key], f"{where}: {KEY_PREFIX + key}")

    agree(where, apply)
    return settings


def _few(names, n: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
