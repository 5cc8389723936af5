"""`save_checkpoint`: every rank writes its share into a temporary directory; rank 0 commits.

The phases, each closed by an `agree` (so a failure anywhere stops every rank together):

1. prepare: rank 0 creates ``.<name>.tmp-<token>`` beside the target (and removes leftovers of
   earlier interrupted saves of the same name); every rank serialises its small state and picks
   the tensors it writes (`writers.assign_writes`: its TP shards, shared out over its DP
   replicas). An asynchronous save copies those tensors to host memory here and returns.
2. write: each rank writes its model and optimizer shard files, its RNG state and ``extra``;
   rank 0 the replicated state; every file is hashed as it is written and fsynced.
3. commit: rank 0 checks that the shards tile every tensor, writes ``manifest.json`` (the
   completeness marker), fsyncs, renames the directory into place, then moves ``latest``
   (temporary name, ``os.replace``) and removes checkpoints beyond ``keep_last``.

A crash before the manifest is written leaves only a hidden temporary directory that no load
accepts. A crash after the manifest but before the rename leaves a complete copy under the
temporary name: a plain save leaves it (loading it directly is refused), while a re-save of an
existing name, whose old copy was already moved aside, is rolled forward to it by the next load
or save of that name (`format.swapped_out_checkpoint`). A crash after the rename leaves a
complete checkpoint, with ``latest`` still naming the previous one until step 3 finishes.
All ranks must see one shared filesystem.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..durable import fsync_dir, hidden_sibling, replace_text_durably, write_bytes_durably
from ..errors import check_positive_int
from . import background
from ._agree import agree, broadcast_object
from .boxes import volume
from .digest import digest_bytes
from .format import (
    COMMON, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, dtype_code, rank_file_name, read_manifest,
    shard_file_name, swapped_out_checkpoint, write_safetensors,
)
from .adapters import resolve_optimizer
from .lora_state import LoRABase, as_base, lora_record, trainable_state
from .optimizer import OptimizerAdapter
from .pieces import Piece, current_context, model_pieces, unwrap
from .retention import remove_beyond
from .rng import capture_rng
from .writers import assign_writes, name_in_file

_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")  # a DeepSpeedEngine's step counters


@dataclass
class SavePlan:
    """One save: where it goes and what it reads from."""

    final: Path
    tmp: Path
    token: str
    ctx: Any
    module: torch.nn.Module
    engine: Any
    optimizer: Optional[OptimizerAdapter]
    scheduler: Any
    scaler: Any
    extra: Any
    step: Optional[int]
    config: Any
    update_latest: bool
    keep_last: Optional[int]
    lora: Optional[dict] = None  # the manifest's ``lora`` record (`lora_state`), None without adapters


@dataclass
class Snapshot:
    """What this rank writes, fixed when `save_checkpoint` is called."""

    model: list[Piece]
    optim: list[Piece]
    rank_blob: bytes
    common_blob: Optional[bytes]  # rank 0 only
    aliases: dict
    ready: Any = None  # a CUDA event the host copies wait for (asynchronous saves on GPUs)


def save_checkpoint(
    path,
    model,
    optimizer=None,
    *,
    scheduler=None,
    scaler=None,
    extra: Any = None,
    step: Optional[int] = None,
    config: Any = None,
    update_latest: bool = True,
    keep_last: Optional[int] = None,
    async_: bool = False,
    base: Union[LoRABase, dict, None] = None,
):
    """Save ``model`` (and optimizer, scheduler, scaler, RNG, ``extra``) to the directory ``path``.

    Collective: every rank of the job calls it with the same ``path``. Per rank it writes only its
    share: the TP shards it holds (``bd_shard_specs()`` of the layers; Adam moments are sharded like
    their parameters; TP-replicated tensors come from TP rank 0), shared out over the DP replicas
    of its TP rank, so each of dp replicas writes about 1/dp of the bytes. No rank gathers the full
    model, and a DeepSpeed ZeRO optimizer is saved from each DP rank's own partition.

    ``model``: an ``nn.Module``, a DDP wrapper or a DeepSpeedEngine (ZeRO 0-2; ``scheduler`` then
    defaults to the engine's). ``scheduler``/``scaler``: anything with ``state_dict()``. ``extra``:
    per-rank user state (a data position, ...) of tensors, numbers, strings, lists, tuples and
    dicts; `load_checkpoint` returns it. ``step``: recorded in the manifest (defaults to a
    DeepSpeed engine's ``global_steps``). ``config``: a JSON-able dict or an OmegaConf config,
    recorded in the manifest. ``update_latest``: point ``<parent>/latest`` at this checkpoint once
    it is complete. ``keep_last``: then remove all but the newest ``keep_last`` complete
    checkpoints beside it (never the one ``latest`` names, never one being written).

    A model with low-rank adapters (`bigdense.layers.lora.add_lora`) is saved as its adapters (and
    any parameter left trainable) with their optimizer state: the frozen base is not copied but
    named in the manifest's ``lora`` record (the settings, the adapted layers, and ``base``: a
    `LoRABase`, or a dict with ``path`` and ``digest``, that `load_checkpoint` can check); see
    `bigdense.checkpoint.lora_state`.

    ``async_=False`` returns the checkpoint directory once it is complete. ``async_=True`` returns
    a `SaveHandle` as soon as the state is snapshotted (tensors copied to host memory: pinned on
    GPUs), so changing the model or optimizer afterwards does not change what is saved; writing,
    hashing, fsync and the commit run in a background thread while training goes on. At most one
    save is in flight: a new save first waits for the previous one. ``handle.wait()`` re-raises a
    failure; `wait_for_checkpoints` waits for the save in flight. The save is atomic either way:
    see this module's docstring.
    """
    background.wait_for_checkpoints(raise_failure=False)  # at most one in flight; its failure stays with its handle
    plan = _plan(path, model, optimizer, scheduler, scaler, extra, step, config, update_latest, keep_last, base)
    try:
        snapshot = agree(f"save_checkpoint({plan.final}): preparing", lambda: _prepare(plan, copy=async_))
    except BaseException:
        _remove_tmp(plan)
        raise
    if async_:
        return background.start(plan.final, lambda group: _write_and_commit(plan, snapshot, group))
    _write_and_commit(plan, snapshot, group=None)
    return plan.final


def _plan(path, model, optimizer, scheduler, scaler, extra, step, config, update_latest, keep_last, base) -> SavePlan:
    final = Path(path)
    if final.name in ("", ".", "..", LATEST):
        raise CheckpointError(f"save_checkpoint: {str(path)!r} cannot name a checkpoint directory")
    if keep_last is not None:
        check_positive_int("save_checkpoint: keep_last", keep_last, error=CheckpointError)
    module, engine = unwrap(model)
    ctx = current_context()
    adapter = resolve_optimizer(optimizer, engine)
    if engine is not None:
        scheduler = scheduler if scheduler is not None else getattr(engine, "lr_scheduler", None)
        step = step if step is not None else getattr(engine, "global_steps", None)
    lora = lora_record(module, as_base(base))
    if lora is None and base is not None:
        raise ValueError(f"save_checkpoint: base={base!r} names the frozen base of a model with adapters; "
                         f"{type(module).__name__} has none (bd.add_lora)")
    token = broadcast_object(f"{os.getpid()}-{os.urandom(4).hex()}" if ctx.rank == 0 else None)
    return SavePlan(final, hidden_sibling(final, "tmp", token), token, ctx, module, engine, adapter, scheduler,
                    scaler, extra, step, config, update_latest, keep_last, lora)


def _prepare(plan: SavePlan, copy: bool) -> Snapshot:
    # Serialise the small state first: a bad ``extra`` or scheduler fails before any file exists.
    ctx = plan.ctx
    rank_blob = _weights_only_bytes({"rng": capture_rng(), "extra": plan.extra, "rank": ctx.rank}, "extra=")
    model_state = model_pieces(plan.module, ctx.tp_rank, ctx.tp_size)
    if plan.lora is not None:  # the adapters (and anything left trainable), not the frozen base
        model_state = trainable_state(model_state, plan.module)
    optim_pieces = plan.optimizer.pieces(model_state) if plan.optimizer is not None else []
    common_blob = _common_blob(plan, model_state) if ctx.rank == 0 else None
    if ctx.rank == 0:
        _make_tmp(plan)
    stored = [[box for p in pieces for box in p.boxes()] for pieces in (model_state.pieces.values(), optim_pieces)]
    mine = [assign_writes(p, ctx.tp_rank, ctx.dp_rank, ctx.dp_size) for p in stored]
    snapshot = Snapshot(mine[0], mine[1], rank_blob, common_blob, model_state.aliases)
    return background.copy_to_host(snapshot) if copy else snapshot


def _common_blob(plan: SavePlan, model_state) -> bytes:
    engine, opt = plan.engine, plan.optimizer
    common = {
        "optimizer": None if opt is None else opt.common(model_state),
        "scheduler": None if plan.scheduler is None else plan.scheduler.state_dict(),
        "scaler": None if plan.scaler is None else plan.scaler.state_dict(),
        "model_non_tensor": model_state.non_tensor,
        "deepspeed": None if engine is None else {k: getattr(engine, k) for k in _ENGINE_COUNTERS if hasattr(engine, k)},
    }
    return _weights_only_bytes(common, "optimizer/scheduler/scaler state")


def _make_tmp(plan: SavePlan) -> None:
    """Rank 0: the temporary directory, after refusing a target that is not a checkpoint and
    finishing or removing what earlier interrupted saves of this name left."""
    final, parent = plan.final, plan.final.parent
    if final.is_file() or final.is_symlink() or (final.is_dir() and not (final / MANIFEST).is_file()):
        raise CheckpointError(
            f"save_checkpoint: {final} exists and is not a bigdense checkpoint (a file, or a directory without "
            f"{MANIFEST}); refusing to replace it -- choose another name or remove it"
        )
    if final.is_dir():
        read_manifest(final)  # a foreign manifest.json is refused too
    parent.mkdir(parents=True, exist_ok=True)
    rolled = None if final.exists() else swapped_out_checkpoint(final)
    if rolled is not None:  # an earlier re-save died between its renames: finish it
        os.rename(rolled, final)
        fsync_dir(parent)
    for stale in [*parent.glob(f".{final.name}.tmp-*"), *parent.glob(f".{final.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    plan.tmp.mkdir()


def _write_and_commit(plan: SavePlan, snapshot: Snapshot, group) -> Path:
    try:
        per_rank = agree(f"save_checkpoint({plan.final}): writing shards", lambda: _write_files(plan, snapshot),
                         gather=True, group=group)
        agree(f"save_checkpoint({plan.final}): committing", lambda: _commit(plan, per_rank), group=group)
    except BaseException:
        _remove_tmp(plan)
        raise
    return plan.final


def _remove_tmp(plan: SavePlan) -> None:
    if plan.ctx.rank == 0:
        shutil.rmtree(plan.tmp, ignore_errors=True)


def _write_files(plan: SavePlan, snapshot: Snapshot) -> dict:
    """This rank's files; returns its manifest records, files and bytes written."""
    if snapshot.ready is not None:
        snapshot.ready.synchronize()
    ctx, tmp = plan.ctx, plan.tmp
    records, files = [], {}
    for kind, pieces in (("model", snapshot.model), ("optim", snapshot.optim)):
        if pieces:
            name = shard_file_name(kind, ctx.tp_rank, ctx.tp_size, ctx.dp_rank, ctx.dp_size)
            records += _guarded(tmp / name, lambda: _write_shards(tmp / name, kind, pieces))
            files[name] = {"bytes": (tmp / name).stat().st_size}
    blobs = {rank_file_name(ctx.rank): snapshot.rank_blob}
    if snapshot.common_blob is not None:
        blobs[COMMON] = snapshot.common_blob
    for name, blob in blobs.items():
        _guarded(tmp / name, lambda: write_bytes_durably(tmp / name, blob))
        files[name] = {"bytes": len(blob), "hash": digest_bytes(blob)}
    written = sum(info["bytes"] for info in files.values())
    return {"records": records, "files": files, "bytes_written": written, "aliases": snapshot.aliases}


def _guarded(path: Path, write):
    """Run ``write``; an OS error (a full disk, a read-only or vanished directory) names the file."""
    try:
        return write()
    except OSError as exc:
        why = "the filesystem is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "the write failed"
        raise CheckpointError(f"cannot write {path}: {why} ({exc.strerror or exc})") from exc


def _write_shards(path: Path, kind: str, pieces: list[Piece]) -> list[dict]:
    by_name = {name_in_file(p): p for p in pieces}
    digests = write_safetensors(path, [(n, p.tensor.dtype, p.shape) for n, p in by_name.items()],
                                lambda n: by_name[n].tensor, {"format": FORMAT_NAME, "kind": kind})
    return [
        {
            "key": p.key, "global_shape": list(p.global_shape), "dtype": dtype_code(p.tensor.dtype),
            "shard_dim": p.shard_dim,
            "shard": {"file": path.name, "name": n, "offsets": list(p.offsets), "shape": list(p.shape),
                      "hash": digests[n]},
        }
        for n, p in by_name.items()
    ]


def _commit(plan: SavePlan, per_rank: list[dict]) -> None:
    """Rank 0: the manifest, the rename, ``latest``, retention."""
    if plan.ctx.rank != 0:
        return
    tmp, final, parent = plan.tmp, plan.final, plan.final.parent
    write_bytes_durably(tmp / MANIFEST, json.dumps(_manifest(plan, per_rank), indent=1).encode())
    fsync_dir(tmp)
    if final.exists():  # re-saving a name (e.g. after a restart): swap, then drop the old one
        old = hidden_sibling(final, "old", plan.token)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(parent)
    if plan.update_latest:
        replace_text_durably(parent / LATEST, final.name + "\n", f"tmp-{plan.token}")
    if plan.keep_last is not None:
        remove_beyond(parent, plan.keep_last, keep=final)


def _manifest(plan: SavePlan, per_rank: list[dict]) -> dict:
    tensors, files = _merge_records(per_rank)
    ctx, opt = plan.ctx, plan.optimizer
    return {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "step": plan.step, "config": _to_json(plan.config),
        "created_unix": time.time(), "torch_version": torch.__version__,
        "layout": {"tp": ctx.tp_size, "dp": ctx.dp_size, "world_size": ctx.world_size},
        "optimizer_engine": None if opt is None else opt.kind,
        "optimizer_algorithm": None if opt is None else opt.algorithm,  # `optimizer.check_optimizer_algorithm`
        "has": {"optimizer": opt is not None, "scheduler": plan.scheduler is not None, "scaler": plan.scaler is not None},
        "aliases": per_rank[0]["aliases"], "tensors": tensors, "files": files,
        **({"lora": plan.lora} if plan.lora is not None else {}),
        "bytes_written_per_rank": [r["bytes_written"] for r in per_rank],
    }


def _merge_records(per_rank: list[dict]) -> tuple[dict, dict]:
    """Rank 0: the manifest's ``tensors`` and ``files`` from every rank's reports, checked complete."""
    tensors, files = {}, {}
    for report in per_rank:
        files.update(report["files"])
        for rec in report["records"]:
            entry = tensors.setdefault(
                rec["key"], {"global_shape": rec["global_shape"], "dtype": rec["dtype"], "shard_dim": rec["shard_dim"],
                             "shards": []}
            )
            if entry["global_shape"] != rec["global_shape"] or entry["dtype"] != rec["dtype"]:
                raise CheckpointError(
                    f"ranks disagree on tensor {rec['key']}: {entry['global_shape']}/{entry['dtype']} "
                    f"vs {rec['global_shape']}/{rec['dtype']}"
                )
            entry["shards"].append(rec["shard"])
    for key, entry in tensors.items():
        entry["shards"].sort(key=lambda s: s["offsets"])
        stored = sum(volume(s["shape"]) for s in entry["shards"])
        if stored != volume(entry["global_shape"]):
            raise CheckpointError(
                f"tensor {key}: the shards written hold {stored} elements of {volume(entry['global_shape'])} "
                f"(global shape {entry['global_shape']}); the layers' shard specs do not tile the tensor"
            )
    return tensors, files


def _weights_only_bytes(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, refused now if a ``weights_only`` load could not read them back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"{what} cannot be stored: it must hold only tensors, numbers, strings, lists, tuples and dicts "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    return buffer.getvalue()


def _to_json(config) -> Any:
    if config is None:
        return None
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    return json.loads(json.dumps(config, default=str))
