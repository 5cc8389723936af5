"""`load_checkpoint`: read a checkpoint at any TP x DP layout, checking everything before touching anything.

Each rank needs a box of every global tensor (its shard, or the whole tensor if replicated). For
each stored shard that overlaps that box it copies the overlap straight out of the mmapped file,
so a rank reads O(its own shard) whatever layout wrote the checkpoint, and the values are the
stored bytes (bit-identical; only a dtype change, if the model's differs, converts them).

Two phases, each closed by an `agree`: (1) plan and verify -- names, global shapes, files,
sizes, checksums of every stored shard this rank will read, optimizer groups -- and (2) apply.
A bad checkpoint therefore fails on every rank in phase 1, with the model, the optimizer and the
RNG untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ._agree import agree
from .format import (
    COMMON, CheckpointError, SafetensorsReader, box_overlap, check_files, dtype_from_code, load_pickled,
    narrow_box, rank_file_name, read_manifest, resolve_checkpoint, volume,
)
from .state import (
    FP32_MASTER, DeepSpeedOptimizer, check_optimizer_groups, current_context, model_pieces, resolve_optimizer,
    restore_rng,
    torch_optimizer_state_dict, unwrap,
)


@dataclass
class CheckpointInfo:
    """What `load_checkpoint` returns: where it loaded from and the user state saved with it."""

    path: Path
    step: Optional[int]
    extra: Any
    config: Any
    saved_layout: dict
    missing: list[str] = field(default_factory=list)  # model tensors not in the checkpoint (strict=False)
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors not in the model (strict=False)


@dataclass
class _Read:
    """Copy the overlap box ``off/shape`` from stored shard ``name`` of ``file`` (at ``src_off``)."""

    file: str
    name: str
    src_off: list[int]
    off: list[int]
    shape: list[int]


def _plan_reads(ckpt: Path, key: str, entry: dict, off, shape) -> list[_Read]:
    reads, covered = [], 0
    for shard in entry["shards"]:
        hit = box_overlap(off, shape, shard["offsets"], shard["shape"])
        if hit is not None:
            reads.append(_Read(shard["file"], shard["name"], shard["offsets"], *hit))
            covered += volume(hit[1])
    if covered != volume(shape):
        raise CheckpointError(
            f"{ckpt}: tensor {key}: the stored shards cover {covered} of the {volume(shape)} elements this rank "
            f"needs (box at {list(off)} of shape {list(shape)}): a shard is missing from the manifest"
        )
    return reads


def _source_rank(saved: dict, ctx) -> int:
    """Whose RNG state and ``extra`` this rank takes: its own at the same layout, else the saved rank
    at the same (dp, tp) position modulo the saved sizes."""
    if saved["tp"] == ctx.tp_size and saved["dp"] == ctx.dp_size:
        return ctx.rank
    return (ctx.dp_rank % saved["dp"]) * saved["tp"] + ctx.tp_rank % saved["tp"]


def _match_model(ckpt: Path, manifest: dict, model_state, strict: bool):
    """``(targets, missing, unexpected)``: targets are ``(stored key, tensor to fill, its offsets)``."""
    tensors, aliases = manifest["tensors"], manifest.get("aliases", {})
    targets, missing = [], []
    for name, piece in model_state.pieces.items():
        key = f"model/{aliases.get(name, name)}"
        if key not in tensors:
            missing.append(name)
            continue
        if list(piece.global_shape) != tensors[key]["global_shape"]:
            raise CheckpointError(
                f"{ckpt}: tensor {name!r} has global shape {tensors[key]['global_shape']} in the checkpoint but "
                f"{list(piece.global_shape)} in the model (a checkpoint of another model?)"
            )
        targets.append((key, piece.tensor, piece.offsets))
    wanted = {f"model/{aliases.get(n, n)}" for n in [*model_state.pieces, *model_state.aliases]}
    unexpected = sorted(k[len("model/"):] for k in tensors if k.startswith("model/") and k not in wanted)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{ckpt} does not match the model (a checkpoint of another model?): "
            f"missing from the checkpoint {missing[:8]}, not in the model {unexpected[:8]}"
        )
    return targets, missing, unexpected


def _match_optimizer(manifest: dict, common: dict, opt, model_state):
    """``(targets, saved param groups)``; targets are ``(stored key, param name, state key, offsets,
    shape, dtype)``: state shaped like its parameter takes the parameter's box, the rest is whole."""
    tensors, aliases = manifest["tensors"], manifest.get("aliases", {})
    groups = common["optimizer"]["param_groups"]
    is_deepspeed = isinstance(opt, DeepSpeedOptimizer)
    names = opt.group_names(model_state) if is_deepspeed else [
        [model_state.canonical.get(id(p), "<not in the model>") for p in g["params"]] for g in opt.param_groups
    ]
    check_optimizer_groups(names, groups)
    targets = []
    for name in (n for group in names for n in group):
        param = model_state.pieces[name]
        prefix = f"optim/{aliases.get(name, name)}/"
        for key in (k for k in tensors if k.startswith(prefix)):
            if key.endswith(f"/{FP32_MASTER}") and not is_deepspeed:
                continue  # DeepSpeed's fp32 master weights mean nothing to a plain optimizer
            shape = tuple(tensors[key]["global_shape"])
            if len(shape) > 0 and shape == param.global_shape:
                off, shape = param.offsets, param.shape
            else:
                off = (0,) * len(shape)
            targets.append((key, name, key[len(prefix):], off, shape, dtype_from_code(tensors[key]["dtype"])))
    return targets, groups


def _open_and_verify(ckpt: Path, manifest: dict, reads: dict, readers: dict, verify: bool) -> None:
    """Open every shard file this rank reads (into ``readers``) and check each stored shard it
    overlaps: header dtype/shape against the manifest, and (``verify``) its sha256."""
    tensors = manifest["tensors"]
    check_files(ckpt, manifest, sorted({r.file for key_reads in reads.values() for r in key_reads}))
    checked = set()
    for key, key_reads in reads.items():
        entry = tensors[key]
        for r in key_reads:
            if r.file not in readers:
                readers[r.file] = SafetensorsReader(ckpt / r.file)
            if (r.file, r.name) in checked:
                continue
            shard = next(s for s in entry["shards"] if s["file"] == r.file and s["name"] == r.name)
            dtype, shape = readers[r.file].describe(r.name)
            if list(shape) != shard["shape"] or dtype != dtype_from_code(entry["dtype"]):
                raise CheckpointError(
                    f"{ckpt / r.file}: tensor {r.name!r} is {dtype}{list(shape)} in the file but "
                    f"{entry['dtype']}{shard['shape']} in the manifest (corrupted)"
                )
            if verify and readers[r.file].sha256(r.name) != shard["sha256"]:
                raise CheckpointError(f"{ckpt / r.file}: tensor {r.name!r} fails its checksum (corrupted file)")
            checked.add((r.file, r.name))


def load_checkpoint(
    path,
    model,
    optimizer=None,
    *,
    scheduler=None,
    scaler=None,
    strict: bool = True,
    load_rng: bool = True,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint saved at any TP x DP layout into ``model`` (and optimizer, scheduler, scaler).

    Collective: every rank calls it. ``path`` is a checkpoint directory, a ``latest`` pointer file,
    or the directory holding the pointer. Each rank reads only the parts of stored shards that
    overlap its own shards (memory O(own shard)); values arrive bit-identical. ``model`` may be an
    ``nn.Module``, a DDP wrapper or a DeepSpeedEngine (its optimizer is loaded through DeepSpeed's
    per-parameter API, its fp32 master weights are set from the checkpoint, and ``scheduler``
    defaults to the engine's); optimizer state saved by either kind loads into the other.

    ``strict``: model tensor names must match exactly, and a requested optimizer/scheduler/scaler
    must be in the checkpoint; with ``strict=False`` missing pieces are skipped and listed in the
    result. Global shapes must always match. ``load_rng``: restore this rank's RNG states (at another
    layout: those of the saved rank at the same position modulo the saved tp/dp). ``verify``:
    check the sha256 of every stored shard this rank reads from (hashing streams each such shard
    once through the page cache; the copies themselves touch only the overlapping bytes).

    Any problem -- another model's checkpoint, a missing, truncated or corrupted file, a missing
    shard -- raises `CheckpointError` naming the file and tensor on every rank, before anything is
    modified.
    """
    module, engine = unwrap(model)
    ctx = current_context()
    opt = resolve_optimizer(optimizer, engine)
    if engine is not None and scheduler is None:
        scheduler = getattr(engine, "lr_scheduler", None)

    readers: dict[str, SafetensorsReader] = {}  # kept open from verification to the copies

    def plan():
        ckpt = resolve_checkpoint(path)
        manifest = read_manifest(ckpt)
        rank_file = rank_file_name(_source_rank(manifest["layout"], ctx))
        check_files(ckpt, manifest, [COMMON, rank_file])
        common, rank_state = load_pickled(ckpt / COMMON), load_pickled(ckpt / rank_file)
        has = manifest["has"]
        model_state = model_pieces(module, ctx.tp_rank, ctx.tp_size)
        targets, missing, unexpected = _match_model(ckpt, manifest, model_state, strict)
        optim_targets, optim_groups = [], None
        if opt is not None and has["optimizer"]:
            optim_targets, optim_groups = _match_optimizer(manifest, common, opt, model_state)
        elif opt is not None and strict and (optimizer is not None or engine is None):
            raise CheckpointError(f"{ckpt} holds no optimizer state (saved with optimizer=None); pass optimizer=None")
        for what, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None and not has[what] and strict:
                raise CheckpointError(f"{ckpt} holds no {what} state; pass {what}=None or strict=False")
        boxes = [(key, off, tuple(t.shape)) for key, t, off in targets]
        boxes += [(key, off, shape) for key, _, _, off, shape, _ in optim_targets]
        reads = {key: _plan_reads(ckpt, key, manifest["tensors"][key], off, shape) for key, off, shape in boxes}
        _open_and_verify(ckpt, manifest, reads, readers, verify)
        return (ckpt, manifest, common, rank_state, model_state, targets, optim_targets, optim_groups,
                reads, missing, unexpected)

    try:
        (ckpt, manifest, common, rank_state, model_state, targets, optim_targets, optim_groups,
         reads, missing, unexpected) = agree(f"load_checkpoint({path})", plan)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise

    def fill(target: torch.Tensor, target_off, key: str) -> None:
        for r in reads[key]:
            src = narrow_box(readers[r.file].view(r.name), r.src_off, r.off, r.shape)
            narrow_box(target, target_off, r.off, r.shape).copy_(src)

    def apply():
        try:
            optim_tensors: dict[str, dict[str, torch.Tensor]] = {}
            for key, name, state_key, off, shape, dtype in optim_targets:
                # Scalars (step counters) stay on the CPU, where torch optimizers keep them.
                device = model_state.pieces[name].tensor.device if len(shape) else "cpu"
                value = torch.empty(shape, dtype=dtype, device=device)
                fill(value, off, key)
                optim_tensors.setdefault(name, {})[state_key] = value
            with torch.no_grad():
                for key, tensor, off in targets:
                    fill(tensor, off, key)
        finally:
            for reader in readers.values():
                reader.close()
        for name, value in common.get("model_non_tensor", {}).items():
            owner = module.get_submodule(name.rsplit(".", 1)[0] if "." in name else "")
            owner.set_extra_state(value)
        if isinstance(opt, DeepSpeedOptimizer):
            opt.load(model_state, optim_groups, optim_tensors)
            if optim_groups is not None:
                opt.load_loss_scaler_state(common.get("deepspeed_loss_scaler"))
        elif opt is not None and optim_groups is not None:
            non_tensor = common["optimizer"]["non_tensor_state"]
            opt.load_state_dict(torch_optimizer_state_dict(opt, model_state, optim_groups, optim_tensors, non_tensor))
        if scheduler is not None and common["scheduler"] is not None:
            scheduler.load_state_dict(common["scheduler"])
        if scaler is not None and common["scaler"] is not None:
            scaler.load_state_dict(common["scaler"])
        if engine is not None and common.get("deepspeed"):
            for k, v in common["deepspeed"].items():
                setattr(engine, k, v)
        if load_rng:
            restore_rng(rank_state["rng"])

    agree(f"load_checkpoint({ckpt}): applying", apply)
    return CheckpointInfo(ckpt, manifest.get("step"), rank_state.get("extra"), manifest.get("config"),
                          manifest["layout"], missing, unexpected)
