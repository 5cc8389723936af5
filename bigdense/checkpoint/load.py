"""`load_checkpoint`: read a checkpoint at any TP x DP layout, checking everything before touching anything.

Each rank needs a box of every global tensor (its shard, or the whole tensor if replicated). For
each stored shard that overlaps that box it copies the overlap straight out of the mmapped file,
so a rank reads O(its own shard) whatever layout wrote the checkpoint, and the values are the
stored bytes (bit-identical; only a dtype change, if the model's differs, converts them).

The phases, each closed by an `agree`: (1) plan -- names, global shapes, files, sizes, headers
of every stored shard this rank reads, optimizer groups -- (2) verify the checksums, each stored
shard hashed by the rank `verify.assign_hashing` picks, and (3) apply. A bad checkpoint
therefore fails on every rank before phase 3, with the model, the optimizer and the RNG untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ._agree import agree
from .boxes import box_overlap, narrow_box, volume
from .format import (
    COMMON, CheckpointError, CheckpointMismatch, SafetensorsReader, check_files, dtype_from_code, load_pickled,
    rank_file_name, read_manifest, resolve_checkpoint,
)
from .adapters import resolve_optimizer
from .lora_state import LoRABase, as_base, check_lora_load, trainable_state
from .optimizer import OptimizerAdapter, check_optimizer_algorithm, check_optimizer_groups
from .pieces import ModelState, current_context, model_pieces, unwrap
from ..compression.prune_masks import attach_saved_masks
from .rng import restore_rng
from .verify import assign_hashing, node_name, verify_mode


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
    bytes_copied: int = 0  # bytes this rank copied out of shard files
    bytes_hashed: int = 0  # bytes this rank hashed to verify them
    lora: Optional[dict] = None  # the manifest's ``lora`` record of a LoRA checkpoint (`lora_state`)


@dataclass
class _Read:
    """Copy the overlap box ``off/shape`` from stored shard ``name`` of ``file`` (at ``src_off``)."""

    file: str
    name: str
    src_off: list[int]
    off: list[int]
    shape: list[int]


@dataclass
class _OptimTarget:
    """A stored optimizer tensor this rank takes: state ``state_key`` of parameter ``param``, of
    local ``shape``, filled box by box (``(local offsets, global offsets, shape)``; several for a
    packed parameter)."""

    key: str
    param: str
    state_key: str
    shape: tuple
    boxes: list
    dtype: torch.dtype


@dataclass
class LoadPlan:
    """Everything phase 1 found; phases 2 and 3 only act on it."""

    ckpt: Path
    manifest: dict
    common: dict
    rank_state: dict
    model_state: ModelState
    model_targets: list[tuple[str, torch.Tensor, tuple]]  # (stored key, tensor to fill, its offsets)
    optim_targets: list[_OptimTarget]
    optim_common: Optional[dict]  # the saved optimizer's groups and non-tensor state, when loading it
    reads: dict[tuple[str, tuple], list[_Read]]  # by (stored key, global offsets of the box filled)
    readers: dict[str, SafetensorsReader]
    missing: list[str]
    unexpected: list[str]
    bytes_hashed: int = 0

    def shard_sizes(self) -> dict[tuple[str, str], int]:
        """``{(file, name): stored bytes}`` of every stored shard this rank reads from."""
        return {(r.file, r.name): self.readers[r.file].nbytes(r.name) for rs in self.reads.values() for r in rs}

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def load_checkpoint(
    path,
    model,
    optimizer=None,
    *,
    scheduler=None,
    scaler=None,
    strict: bool = True,
    load_rng: bool = True,
    verify="node",
    base: Union[LoRABase, dict, None] = None,
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
    layout: those of the saved rank at the same position modulo the saved tp/dp). ``verify``: how
    the checksums of the stored shards read are checked -- ``"node"`` (each once per node, the
    default; ``True``), ``"first"`` (once per job), ``"all"`` (by every rank that reads it),
    ``"none"`` (``False``); see `bigdense.checkpoint.verify`.

    A LoRA checkpoint (of a model with adapters: the adapters and their optimizer state, not the
    frozen base) loads into a model with adapters of the same settings on the same layers, its base
    already loaded; ``base`` (a `LoRABase`, or a dict with ``path`` and ``digest``), when given, must
    be the base the checkpoint names. It is refused, naming what differs, by a model without
    adapters or with other settings; a full checkpoint is refused by a model with adapters unless
    ``strict=False`` and no optimizer (its weights then load into the base): see
    `bigdense.checkpoint.lora_state.check_lora_load`.

    Any problem -- another model's checkpoint, a missing, truncated or corrupted file, a missing
    shard -- raises `CheckpointError` naming the file and tensor on every rank, before anything is
    modified.
    """
    mode = verify_mode(verify)
    module, engine = unwrap(model)
    ctx = current_context()
    opt = resolve_optimizer(optimizer, engine)
    if engine is not None and scheduler is None:
        scheduler = getattr(engine, "lr_scheduler", None)
    requested = {"optimizer": opt is not None and (optimizer is not None or engine is None),
                 "scheduler": scheduler is not None, "scaler": scaler is not None}
    held: list[LoadPlan] = []

    def plan_and_share():
        held.append(_plan(path, module, opt, ctx, requested, strict, as_base(base)))
        return held[0].shard_sizes(), node_name()

    try:
        shared = agree(f"load_checkpoint({path})", plan_and_share, gather=True)
        plan = held[0]
        mine = assign_hashing(mode, [s for s, _ in shared], [n for _, n in shared], ctx.rank)
        agree(f"load_checkpoint({plan.ckpt}): verifying checksums", lambda: _verify(plan, mine))
    except BaseException:
        for p in held:
            p.close()
        raise
    copied = agree(f"load_checkpoint({plan.ckpt}): applying",
                   lambda: _apply(plan, module, engine, opt, scheduler, scaler, load_rng))
    return CheckpointInfo(plan.ckpt, plan.manifest.get("step"), plan.rank_state.get("extra"),
                          plan.manifest.get("config"), plan.manifest["layout"], plan.missing, plan.unexpected,
                          copied, plan.bytes_hashed, plan.manifest.get("lora"))


def _plan(path, module, opt: Optional[OptimizerAdapter], ctx, requested: dict, strict: bool,
          base: Optional[LoRABase]) -> LoadPlan:
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    rank_file = rank_file_name(_source_rank(manifest["layout"], ctx))
    check_files(ckpt, manifest, [COMMON, rank_file])
    common, rank_state = load_pickled(ckpt / COMMON), load_pickled(ckpt / rank_file)
    has = manifest["has"]
    for what, wanted in requested.items():
        if wanted and not has[what] and strict:
            hint = "pass optimizer=None" if what == "optimizer" else f"pass {what}=None or strict=False"
            raise CheckpointError(f"{ckpt} holds no {what} state (saved with {what}=None); {hint}")
    if opt is not None and has["optimizer"]:  # before the masks below: a refused load changes nothing
        check_optimizer_algorithm(ckpt, manifest.get("optimizer_algorithm"), opt.algorithm)
    adapters_only = check_lora_load(ckpt, manifest, module, base=base, strict=strict,
                                    optimizer=requested["optimizer"] and has["optimizer"])
    # A pruned model's masks are part of its state: the layers that had one get one to load into.
    attach_saved_masks(module, [k[len("model/"):] for k in manifest["tensors"] if k.startswith("model/")])
    model_state = model_pieces(module, ctx.tp_rank, ctx.tp_size)
    if adapters_only:  # the frozen base is already in the model; the checkpoint holds the rest
        model_state = trainable_state(model_state, module)
    targets, missing, unexpected = _match_model(ckpt, manifest, model_state, strict)
    optim_targets, optim_common = [], None
    if opt is not None and has["optimizer"]:
        optim_common = common["optimizer"]
        optim_targets = _match_optimizer(manifest, optim_common, opt, model_state)
    boxes = [(key, off, tuple(t.shape)) for key, t, off in targets]
    boxes += [(t.key, goff, shape) for t in optim_targets for _, goff, shape in t.boxes]
    reads = {(key, tuple(off)): _plan_reads(ckpt, key, manifest["tensors"][key], off, shape)
             for key, off, shape in boxes}
    plan = LoadPlan(ckpt, manifest, common, rank_state, model_state, targets, optim_targets, optim_common, reads, {},
                    missing, unexpected)
    try:
        _open_and_check_headers(plan)
    except BaseException:
        plan.close()
        raise
    return plan


def _source_rank(saved: dict, ctx) -> int:
    """Whose RNG state and ``extra`` this rank takes: its own at the same layout, else the saved rank
    at the same (dp, tp) position modulo the saved sizes."""
    if saved["tp"] == ctx.tp_size and saved["dp"] == ctx.dp_size:
        return ctx.rank
    return (ctx.dp_rank % saved["dp"]) * saved["tp"] + ctx.tp_rank % saved["tp"]


def _match_model(ckpt: Path, manifest: dict, model_state: ModelState, strict: bool):
    """``(targets, missing, unexpected)``: targets are ``(stored key, tensor to fill, its offsets)``."""
    tensors, aliases = manifest["tensors"], manifest.get("aliases", {})
    targets, missing = [], []
    for name, piece in model_state.pieces.items():
        key = f"model/{aliases.get(name, name)}"
        if key not in tensors:
            missing.append(name)
            continue
        if list(piece.global_shape) != tensors[key]["global_shape"]:
            raise CheckpointMismatch(
                f"{ckpt}: tensor {name!r} has global shape {tensors[key]['global_shape']} in the checkpoint but "
                f"{list(piece.global_shape)} in the model (a checkpoint of another model?)"
            )
        targets += [(key, box.tensor, box.offsets) for box in piece.boxes()]
    wanted = {f"model/{aliases.get(n, n)}" for n in [*model_state.pieces, *model_state.aliases]}
    unexpected = sorted(k[len("model/"):] for k in tensors if k.startswith("model/") and k not in wanted)
    if strict and (missing or unexpected):
        raise CheckpointMismatch(
            f"{ckpt} does not match the model (a checkpoint of another model?): "
            f"missing from the checkpoint {missing[:8]}, not in the model {unexpected[:8]}"
        )
    return targets, missing, unexpected


def _match_optimizer(manifest: dict, saved: dict, opt: OptimizerAdapter, model_state: ModelState):
    """The stored optimizer tensors this rank takes: state shaped like its parameter takes the
    parameter's box, the rest is whole."""
    tensors, aliases = manifest["tensors"], manifest.get("aliases", {})
    names = opt.group_names(model_state)
    check_optimizer_groups(names, saved["param_groups"])
    targets = []
    for name in (n for group in names for n in group):
        param = model_state.pieces.get(name)
        if param is None:  # a frozen base parameter of a model with adapters: no state is stored for it
            continue
        prefix = f"optim/{aliases.get(name, name)}/"
        for key in (k for k in tensors if k.startswith(prefix) and opt.loads_key(k[len(prefix):])):
            shape = tuple(tensors[key]["global_shape"])
            if len(shape) > 0 and shape == param.global_shape:  # shaped like the parameter: boxed like it
                shape, boxes = param.shape, param.to_global((0,) * len(shape), param.shape)
            else:
                boxes = [((0,) * len(shape), (0,) * len(shape), shape)]
            targets.append(_OptimTarget(key, name, key[len(prefix):], shape, boxes,
                                        dtype_from_code(tensors[key]["dtype"])))
    return targets


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


def _shard_record(plan: LoadPlan, key: str, r: _Read) -> dict:
    return next(s for s in plan.manifest["tensors"][key]["shards"] if s["file"] == r.file and s["name"] == r.name)


def _open_and_check_headers(plan: LoadPlan) -> None:
    """Open every shard file this rank reads and check each stored shard's header dtype/shape
    against the manifest (files missing or truncated fail here too)."""
    check_files(plan.ckpt, plan.manifest, sorted({r.file for rs in plan.reads.values() for r in rs}))
    for (key, _), key_reads in plan.reads.items():
        entry = plan.manifest["tensors"][key]
        for r in key_reads:
            if r.file not in plan.readers:
                plan.readers[r.file] = SafetensorsReader(plan.ckpt / r.file)
            shard = _shard_record(plan, key, r)
            dtype, shape = plan.readers[r.file].describe(r.name)
            if list(shape) != shard["shape"] or dtype != dtype_from_code(entry["dtype"]):
                raise CheckpointError(
                    f"{plan.ckpt / r.file}: tensor {r.name!r} is {dtype}{list(shape)} in the file but "
                    f"{entry['dtype']}{shard['shape']} in the manifest (corrupted)"
                )


def _verify(plan: LoadPlan, mine: set) -> None:
    """Hash the stored shards assigned to this rank against their manifest digests."""
    done = set()
    for (key, _), key_reads in plan.reads.items():
        for r in key_reads:
            if (r.file, r.name) not in mine or (r.file, r.name) in done:
                continue
            reader = plan.readers[r.file]
            if not reader.matches(r.name, _shard_record(plan, key, r)):
                raise CheckpointError(f"{plan.ckpt / r.file}: tensor {r.name!r} fails its checksum (corrupted file)")
            plan.bytes_hashed += reader.nbytes(r.name)
            done.add((r.file, r.name))


def _apply(plan: LoadPlan, module, engine, opt, scheduler, scaler, load_rng: bool) -> int:
    """Copy every planned box in, then the small state; returns the bytes copied from the files."""
    try:
        copied, optim_tensors = _copy_tensors(plan)
    finally:
        plan.close()
    common = plan.common
    for name, value in common.get("model_non_tensor", {}).items():
        owner = module.get_submodule(name.rsplit(".", 1)[0] if "." in name else "")
        owner.set_extra_state(value)
    if opt is not None and plan.optim_common is not None:
        opt.load(plan.model_state, _with_legacy_fields(plan.optim_common, common), optim_tensors)
    if scheduler is not None and common["scheduler"] is not None:
        scheduler.load_state_dict(common["scheduler"])
    if scaler is not None and common["scaler"] is not None:
        scaler.load_state_dict(common["scaler"])
    if engine is not None and common.get("deepspeed"):
        for k, v in common["deepspeed"].items():
            setattr(engine, k, v)
    if load_rng:
        restore_rng(plan.rank_state["rng"])
    return copied


def _copy_tensors(plan: LoadPlan) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    copied = 0

    def fill(target: torch.Tensor, target_off, key: str) -> None:
        nonlocal copied
        for r in plan.reads[key, tuple(target_off)]:
            src = narrow_box(plan.readers[r.file].view(r.name), r.src_off, r.off, r.shape)
            narrow_box(target, target_off, r.off, r.shape).copy_(src)
            copied += src.numel() * src.element_size()

    optim_tensors: dict[str, dict[str, torch.Tensor]] = {}
    for t in plan.optim_targets:
        # Scalars (step counters) stay on the CPU, where torch optimizers keep them.
        device = plan.model_state.pieces[t.param].tensor.device if len(t.shape) else "cpu"
        value = torch.empty(t.shape, dtype=t.dtype, device=device)
        for local_off, global_off, shape in t.boxes:
            fill(narrow_box(value, (0,) * value.dim(), local_off, shape), global_off, t.key)
        optim_tensors.setdefault(t.param, {})[t.state_key] = value
    with torch.no_grad():
        for key, tensor, off in plan.model_targets:
            fill(tensor, off, key)
    return copied, optim_tensors


def _with_legacy_fields(optim_common: dict, common: dict) -> dict:
    """The first format version kept DeepSpeed's loss scaler beside the optimizer state."""
    if "loss_scaler" not in optim_common and common.get("deepspeed_loss_scaler") is not None:
        return {**optim_common, "loss_scaler": common["deepspeed_loss_scaler"]}
    return optim_common
