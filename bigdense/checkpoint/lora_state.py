"""Checkpoints of a model with low-rank adapters: what they hold, what they name, how they load.

A model with adapters (`bigdense.layers.lora.add_lora`) is saved as what its training changes:
the adapter factors (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``), any parameter still
trainable beside them, and the optimizer state (which is theirs alone). The frozen base -- every
other parameter and the buffers -- is not copied; the manifest names it instead, in its ``lora``
record (`lora_record`)::

    "lora": {"r": 16, "alpha": 32.0, "dropout": 0.05, "rslora": false,
             "layers": ["lm.model.layers.0.self_attn.q_proj", ...],     # the adapted layers, by name
             "overrides": {},          # {layer: {"r", "alpha", "dropout", "rslora"}} where a layer differs
             "base": {"path": "/models/llama-3-8b", "digest": "xxh3_128:..."}}   # or null

The factors are stored as every tensor is (boxes of the global tensor by the layers' shard specs),
so a LoRA checkpoint loads at any TP x DP layout. `check_lora_load` owns the rules for loading one
(and for loading a full checkpoint into a model with adapters); `LoRABase` is the base reference and
`hf_base`, `checkpoint_base`, `seed_base` compute it for the three kinds of base a job has.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch.nn as nn

from ..layers.lora import LoRASettings, adapted_layers, is_lora_name, lora_settings
from .digest import Hasher, digest_bytes
from .format import CheckpointError, CheckpointMismatch, read_manifest, resolve_checkpoint
from .pieces import ModelState

log = logging.getLogger("bigdense")

SETTINGS = ("r", "alpha", "dropout", "rslora")  # the record's names of `LoRASettings`' fields
MEANING = ("r", "alpha", "rslora")  # settings that change what the stored factors mean (dropout does not)


@dataclass(frozen=True)
class LoRABase:
    """The frozen base a LoRA checkpoint's adapters were trained on: ``path`` (a Hugging Face
    directory, a checkpoint, or ``seed:<n>`` for a seeded initialisation) and ``digest``, a tagged
    hash of its contents (what `check_lora_load` compares; the path may move)."""

    path: str
    digest: str

    def describe(self) -> str:
        return f"{self.path} ({self.digest})"


def as_base(value: Union[None, LoRABase, dict]) -> Optional[LoRABase]:
    """``value`` (a `LoRABase`, a dict with ``path`` and ``digest``, or None) as a `LoRABase`."""
    if value is None or isinstance(value, LoRABase):
        return value
    if isinstance(value, dict) and set(value) >= {"path", "digest"}:
        return LoRABase(str(value["path"]), str(value["digest"]))
    raise TypeError(f"base: expected a bigdense.checkpoint.lora_state.LoRABase or a dict with 'path' and 'digest', "
                    f"got {value!r}")


# ---------------------------------------------------------------------------------------------
# the base references of a job


_HF_DIGESTS: dict[tuple, str] = {}  # (directory, its weight files' names, sizes, mtimes) -> digest


def hf_weight_files(directory) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (safetensors, .bin and their indexes), by name."""
    from ..models.hf_dir import WEIGHT_SUFFIXES

    return sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def hf_base(directory) -> LoRABase:
    """The base reference of a Hugging Face directory: its absolute path and the digest of its
    weight files' names and contents (each byte read once per process: memoised by the files'
    names, sizes and modification times)."""
    where = Path(str(directory)).expanduser().resolve()
    if not where.is_dir():
        raise CheckpointError(f"the base directory {where} does not exist")
    files = hf_weight_files(where)
    if not files:
        raise CheckpointError(f"the base directory {where} holds no weight files (*.safetensors, *.bin)")
    key = (str(where), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _HF_DIGESTS:
        hasher = Hasher()
        for path in files:
            hasher.update(f"{path.name}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    hasher.update(chunk)
        _HF_DIGESTS[key] = hasher.hexdigest()
    return LoRABase(str(where), _HF_DIGESTS[key])


def checkpoint_base(path) -> LoRABase:
    """The base reference of a bigdense checkpoint (``trainer.init_from``): its directory and the
    digest of its manifest's model tensors (names, shapes, dtypes and every stored shard's hash)."""
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    if manifest.get("lora"):
        raise CheckpointError(f"{ckpt} holds adapters only (a LoRA checkpoint), not a base model's weights")
    model = {k: v for k, v in manifest["tensors"].items() if k.startswith("model/")}
    return LoRABase(str(ckpt.resolve()), digest_bytes(json.dumps(model, sort_keys=True).encode()))


def seed_base(seed: int, model_config: Any) -> LoRABase:
    """The base reference of a seeded initialisation: ``seed:<seed>`` and the digest of the seed
    and the model config (a JSON-able dict) that together determine its weights."""
    text = json.dumps({"seed": int(seed), "model": model_config}, sort_keys=True, default=str)
    return LoRABase(f"seed:{int(seed)}", digest_bytes(text.encode()))


# ---------------------------------------------------------------------------------------------
# saving


def _settings_dict(settings: LoRASettings) -> dict:
    return {k: getattr(settings, k) for k in SETTINGS}


def lora_record(module: nn.Module, base: Optional[LoRABase] = None) -> Optional[dict]:
    """The manifest's ``lora`` record of ``module`` (see the module docstring), None without adapters.
    The top-level settings are those most layers share; ``overrides`` lists the layers that differ."""
    layers = {name: _settings_dict(lora_settings(layer)) for name, layer in adapted_layers(module).items()}
    if not layers:
        return None
    as_text = [json.dumps(s, sort_keys=True) for s in layers.values()]
    common = json.loads(max(as_text, key=as_text.count))  # the first of the most common: the same on every rank
    return {**common, "layers": list(layers), "overrides": {n: s for n, s in layers.items() if s != common},
            "base": None if base is None else {"path": base.path, "digest": base.digest}}


def layer_settings(record: dict) -> dict[str, dict]:
    """``{layer: {r, alpha, dropout, rslora}}`` of a ``lora`` record."""
    common = {k: record[k] for k in SETTINGS}
    return {name: record.get("overrides", {}).get(name, common) for name in record["layers"]}


def trainable_names(module: nn.Module) -> set[str]:
    """The parameter names a checkpoint of ``module`` with adapters stores: the factors and every
    parameter that still requires a gradient (each under every name it has)."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad or is_lora_name(n)}


def trainable_state(model_state: ModelState, module: nn.Module) -> ModelState:
    """``model_state`` without the frozen base: the pieces (and tied aliases) of `trainable_names`."""
    kept = trainable_names(module)
    pieces = {n: p for n, p in model_state.pieces.items() if n in kept}
    aliases = {a: t for a, t in model_state.aliases.items() if t in pieces}
    return replace(model_state, pieces=pieces, aliases=aliases)


# ---------------------------------------------------------------------------------------------
# loading


def _hint_add(record: dict) -> str:
    alpha = f", alpha={record['alpha']:g}" if record["alpha"] != record["r"] else ""
    extra = f", dropout={record['dropout']:g}" if record["dropout"] else ""
    extra += ", rslora=True" if record["rslora"] else ""
    return f"bd.add_lora(model, r={record['r']}{alpha}{extra}, targets=[...{len(record['layers'])} layers])"


def check_lora_load(ckpt: Path, manifest: dict, module: nn.Module, *, base: Optional[LoRABase], strict: bool,
                    optimizer: bool) -> bool:
    """The rules for loading checkpoint ``ckpt`` into ``module``, as to adapters; True when it is a
    LoRA checkpoint (the model's frozen base is then no part of what is matched and loaded).

    * a LoRA checkpoint into a model without adapters: refused (the adapters need a place, and
      the base is not in the checkpoint): add adapters with the same settings to the base, or
      export the merged model (``python -m bigdense.export_hf CKPT OUT --merge``);
    * a LoRA checkpoint into a model with adapters: the adapted layers and the settings that give
      the factors their meaning (r, alpha, rslora) must be the same; a different dropout is
      logged (it changes training, not the weights); ``base``, when given, must have the digest
      the checkpoint recorded;
    * a full checkpoint into a model with adapters: refused when ``strict`` or with an optimizer
      (the adapters are not in it, and its optimizer state is the full model's); with
      ``strict=False`` and no optimizer its weights load into the base, the adapters kept.
    """
    saved = manifest.get("lora")
    here = lora_record(module)
    if saved and here is None:
        raise CheckpointMismatch(
            f"{ckpt} is a LoRA checkpoint: it holds low-rank adapters of {len(saved['layers'])} layers "
            f"(r={saved['r']}, alpha={saved['alpha']:g}) and their optimizer state, not the base, {_base_text(saved)}; the model has "
            f"no adapters. Load the base, then add adapters with the same settings ({_hint_add(saved)}, or "
            f"lora.r={saved['r']} in a job) before loading it, or write the base with the adapters folded in: "
            f"python -m bigdense.export_hf {ckpt} OUT --merge")
    if not saved and here is not None:
        if strict or optimizer:
            dropped = " and drop its optimizer state of the full model" if optimizer else ""
            raise CheckpointMismatch(
                f"{ckpt} is a full checkpoint (no adapters), the model has adapters on {len(here['layers'])} layers: "
                f"loading it would leave the adapters out{dropped}. "
                f"Load it before add_lora (as trainer.init_from does), or pass strict=False and no optimizer to load "
                f"its weights into the frozen base")
        return False
    if not saved:
        return False
    _check_same_adapters(ckpt, saved, here)
    recorded = as_base(saved.get("base"))
    if base is not None and recorded is not None and base.digest != recorded.digest:
        raise CheckpointMismatch(
            f"{ckpt}: its adapters were trained on the base {recorded.describe()}, but the model's base is "
            f"{base.describe()}: another base (or changed weights). Give the base the checkpoint names, or start "
            f"the adapters anew")
    return True


def _check_same_adapters(ckpt: Path, saved: dict, here: dict) -> None:
    """The adapted layers and their r, alpha, rslora agree; a changed dropout is logged."""
    only_saved = [n for n in saved["layers"] if n not in set(here["layers"])]
    only_here = [n for n in here["layers"] if n not in set(saved["layers"])]
    if only_saved or only_here:
        raise CheckpointMismatch(
            f"{ckpt}: the adapted layers differ (other targets?): only in the checkpoint {only_saved[:4]} "
            f"({len(only_saved)}), only in the model {only_here[:4]} ({len(only_here)})")
    theirs, ours = layer_settings(saved), layer_settings(here)
    differ = {}
    for layer in saved["layers"]:
        for key in SETTINGS:
            if theirs[layer][key] != ours[layer][key]:
                differ.setdefault(key, (theirs[layer][key], ours[layer][key], layer))
    meaning = [k for k in MEANING if k in differ]
    if meaning:
        said = "; ".join(f"{k}={differ[k][0]!r} in the checkpoint, {differ[k][1]!r} in the model (layer {differ[k][2]})"
                         for k in meaning)
        raise CheckpointMismatch(f"{ckpt}: the adapters' settings differ: {said}. Add the adapters with the "
                                 f"checkpoint's settings")
    if "dropout" in differ:
        log.warning("%s: lora dropout %r in the checkpoint, %r now: training goes on with %r", ckpt,
                    differ["dropout"][0], differ["dropout"][1], differ["dropout"][1])


def _base_text(record: dict) -> str:
    base = as_base(record.get("base"))
    return f"which is {base.describe()}" if base is not None else "which it does not name"
