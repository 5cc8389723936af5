"""`save_checkpoint`: every rank writes its own shards into a temporary directory; rank 0 commits.

Commit protocol (each arrow is an `agree`, so a failure anywhere stops every rank together):

1. rank 0 creates ``.<name>.tmp-<token>`` beside the target (and removes leftovers of earlier
   interrupted saves of the same name)                                                        ->
2. TP ranks of DP rank 0 write their model and optimizer shards; every rank writes its RNG state
   and ``extra``; rank 0 writes the replicated state; each file is fsynced                     ->
3. rank 0 checks that the shards tile every tensor, writes ``manifest.json`` (the completeness
   marker), fsyncs, renames the directory into place, then moves ``latest`` (temporary name,
   ``os.replace``)                                                                              ->
4. every rank returns.

A crash before the rename leaves only a hidden temporary directory, which no load accepts
(`resolve_checkpoint` requires the manifest, and nothing points to it); a crash after it leaves a
complete checkpoint, with ``latest`` still naming the previous one until step 3 finishes.
All ranks must see one shared filesystem.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ._agree import agree, broadcast_object
from .format import (
    COMMON, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, dtype_code, file_sha256, fsync_dir,
    rank_file_name, replace_text_durably, shard_file_name, swapped_out_checkpoint, volume, write_bytes_durably,
    write_safetensors,
)
from .state import (
    DeepSpeedOptimizer, capture_rng, current_context, model_pieces, resolve_optimizer, torch_optimizer_pieces, unwrap,
)


_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")  # a DeepSpeedEngine's step counters


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


def _write_shards(tmp: Path, kind: str, pieces, ctx) -> list[dict]:
    """Write this rank's pieces of ``kind`` ("model"/"optim"); return their manifest records."""
    # A sharded tensor's empty shards (more TP ranks than rows) are simply absent.
    mine = [p for p in pieces if (p.sharded and p.tensor.numel() > 0) or (not p.sharded and ctx.tp_rank == 0)]
    if not mine:
        return []
    file_name = shard_file_name(kind, ctx.tp_rank, ctx.tp_size)
    in_file = {p.key: p.key.split("/", 1)[1] for p in mine}
    by_name = {in_file[p.key]: p.tensor for p in mine}
    digests = write_safetensors(tmp / file_name, [(n, t.dtype, t.shape) for n, t in by_name.items()],
                                by_name.__getitem__, {"format": FORMAT_NAME, "kind": kind})
    return [
        {
            "key": p.key, "global_shape": list(p.global_shape), "dtype": dtype_code(p.tensor.dtype),
            "shard_dim": p.shard_dim,
            "shard": {"file": file_name, "name": in_file[p.key], "offsets": list(p.offsets), "shape": list(p.shape),
                      "sha256": digests[in_file[p.key]]},
        }
        for p in mine
    ]


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
) -> Path:
    """Save ``model`` (and optimizer, scheduler, scaler, RNG, ``extra``) to the directory ``path``.

    Collective: every rank of the job calls it with the same ``path``. Per rank it writes only what
    it holds: TP rank ``t`` of DP rank 0 writes its shard of each sharded parameter (the
    ``bd_shard_specs()`` of the layers) and of its optimizer state (Adam moments are sharded like
    their parameters); TP-replicated tensors are written once, by TP rank 0; DP replicas write none
    of these. No rank ever gathers the full model.

    ``model``: an ``nn.Module``, a DDP wrapper or a DeepSpeedEngine (ZeRO 0-2: its own optimizer is
    saved through DeepSpeed's per-parameter API, and ``scheduler`` defaults to the engine's).
    ``scheduler``/``scaler``: anything with ``state_dict()``. ``extra``: per-rank user state (a data
    position, ...) of tensors, numbers, strings, lists, tuples and dicts; `load_checkpoint` returns
    it. ``step``: recorded in the manifest (defaults to a DeepSpeed engine's ``global_steps``).
    ``config``: a JSON-able dict or an OmegaConf config, recorded in the manifest.
    ``update_latest``: point ``<parent>/latest`` at this checkpoint once it is complete.

    Returns the checkpoint directory. The save is atomic: see this module's docstring.
    """
    final = Path(path)
    if final.name in ("", ".", "..", LATEST):
        raise CheckpointError(f"save_checkpoint: {str(path)!r} cannot name a checkpoint directory")
    module, engine = unwrap(model)
    ctx = current_context()
    opt = resolve_optimizer(optimizer, engine)
    if engine is not None:
        scheduler = scheduler if scheduler is not None else getattr(engine, "lr_scheduler", None)
        step = step if step is not None else getattr(engine, "global_steps", None)
    parent = final.parent
    token = broadcast_object(f"{os.getpid()}-{secrets.token_hex(4)}" if ctx.rank == 0 else None)
    tmp = parent / f".{final.name}.tmp-{token}"

    def prepare():
        # Serialise the small state first: a bad ``extra`` or scheduler fails before any file exists.
        rank_blob = _weights_only_bytes({"rng": capture_rng(), "extra": extra, "rank": ctx.rank}, "extra=")
        if ctx.rank == 0:
            parent.mkdir(parents=True, exist_ok=True)
            rolled = None if final.exists() else swapped_out_checkpoint(final)
            if rolled is not None:  # an earlier re-save died between its renames: finish it
                os.rename(rolled, final)
                fsync_dir(parent)
            for stale in [*parent.glob(f".{final.name}.tmp-*"), *parent.glob(f".{final.name}.old-*")]:
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        return rank_blob

    try:
        rank_blob = agree(f"save_checkpoint({final}): preparing", prepare)

        def write():
            model_state = model_pieces(module, ctx.tp_rank, ctx.tp_size)
            optim_pieces, groups, non_tensor = [], None, {}
            if isinstance(opt, DeepSpeedOptimizer):
                optim_pieces, groups = opt.pieces(model_state)  # gathers over DP on every DP rank
            elif opt is not None:
                optim_pieces, groups, non_tensor = torch_optimizer_pieces(opt, model_state)
            records, files = [], {}
            if ctx.dp_rank == 0:
                records += _write_shards(tmp, "model", model_state.pieces.values(), ctx)
                records += _write_shards(tmp, "optim", optim_pieces, ctx)
                for name in {r["shard"]["file"] for r in records}:
                    files[name] = {"bytes": (tmp / name).stat().st_size}
            rank_name = rank_file_name(ctx.rank)
            write_bytes_durably(tmp / rank_name, rank_blob)
            files[rank_name] = {"bytes": len(rank_blob), "sha256": file_sha256(tmp / rank_name)}
            common = None
            if ctx.rank == 0:
                common = {
                    "optimizer": None if opt is None else {"param_groups": groups, "non_tensor_state": non_tensor},
                    "scheduler": None if scheduler is None else scheduler.state_dict(),
                    "scaler": None if scaler is None else scaler.state_dict(),
                    "model_non_tensor": model_state.non_tensor,
                    "deepspeed": None if engine is None else {
                        k: getattr(engine, k) for k in _ENGINE_COUNTERS if hasattr(engine, k)
                    },
                    "deepspeed_loss_scaler": opt.loss_scaler_state() if isinstance(opt, DeepSpeedOptimizer) else None,
                }
                blob = _weights_only_bytes(common, "optimizer/scheduler/scaler state")
                write_bytes_durably(tmp / COMMON, blob)
                files[COMMON] = {"bytes": len(blob), "sha256": file_sha256(tmp / COMMON)}
            return {"records": records, "files": files, "aliases": model_state.aliases,
                    "engine": "deepspeed" if isinstance(opt, DeepSpeedOptimizer) else "torch"}

        per_rank = agree(f"save_checkpoint({final}): writing shards", write, gather=True)

        def commit():
            if ctx.rank != 0:
                return
            tensors, files = _merge_records(per_rank)
            manifest = {
                "format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "config": _to_json(config),
                "created_unix": time.time(), "torch_version": torch.__version__,
                "layout": {"tp": ctx.tp_size, "dp": ctx.dp_size, "world_size": ctx.world_size},
                "optimizer_engine": per_rank[0]["engine"] if opt is not None else None,
                "has": {"optimizer": opt is not None, "scheduler": scheduler is not None, "scaler": scaler is not None},
                "aliases": per_rank[0]["aliases"], "tensors": tensors, "files": files,
            }
            write_bytes_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            fsync_dir(tmp)
            if final.exists():  # re-saving a name (e.g. after a restart): swap, then drop the old one
                old = parent / f".{final.name}.old-{token}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_dir(parent)
            if update_latest:
                replace_text_durably(parent / LATEST, final.name + "\n", f"tmp-{token}")

        agree(f"save_checkpoint({final}): committing", commit)
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
