"""What a checkpoint holds, read from and written back to live objects.

`model_pieces` turns a model into boxes of global tensors using the layers' ``bd_shard_specs()``
(parameters no layer reports are replicated over TP). `torch_optimizer_pieces` and
`deepspeed_optimizer_pieces` do the same for optimizer state, keyed by parameter *name* rather
than by the optimizer's positional index, so the state finds its parameter at any layout and in
either kind of optimizer. RNG capture/restore is here too.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from ..parallel.sharding import ShardSpec
from .format import CheckpointError

FP32_MASTER = "fp32_master"  # optimizer-state key under which DeepSpeed's fp32 master weights are kept


@dataclass
class Piece:
    """One tensor of this rank: its box in the global tensor, and who writes it.

    ``sharded``: each TP rank holds a different box and writes it. Otherwise the tensor is
    replicated over TP and TP rank 0 writes it whole.
    """

    key: str  # "model/<name>" or "optim/<param name>/<state key>"
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sharded: bool
    shard_dim: Optional[int] = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@dataclass
class ModelState:
    pieces: dict[str, Piece]  # by model tensor name
    aliases: dict[str, str]  # tied name -> name it is stored under
    canonical: dict[int, str]  # id(parameter) -> stored name
    non_tensor: dict[str, Any] = field(default_factory=dict)


def unwrap(model) -> tuple[nn.Module, Any]:
    """``(plain module, DeepSpeed engine or None)`` for a module, a DDP wrapper or a DeepSpeedEngine."""
    engine = None
    if type(model).__module__.startswith("deepspeed.") and isinstance(getattr(model, "module", None), nn.Module):
        engine, model = model, model.module
    elif not isinstance(model, nn.Module) and hasattr(model, "checkpoint_state"):
        raise TypeError(
            f"got a bigdense {type(model).__name__}; pass its parts: "
            f"bd.save_checkpoint(path, **engine.checkpoint_state()), likewise bd.load_checkpoint"
        )
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            break
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, a DDP wrapper or a DeepSpeedEngine, got {type(model).__name__}")
    return model, engine


def collect_shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """``{parameter name: ShardSpec}`` for every sharded parameter, from the layers' own reports."""
    specs = {}
    for prefix, sub in module.named_modules():
        report = getattr(sub, "bd_shard_specs", None)
        if callable(report):
            for name, spec in report().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def _box_of(name: str, tensor: torch.Tensor, spec: Optional[ShardSpec], tp_rank: int, tp_size: int):
    if spec is None:
        return tuple(tensor.shape), (0,) * tensor.dim()
    if len(spec.sizes) != tp_size or spec.rank != tp_rank:
        raise CheckpointError(
            f"parameter {name!r} is sharded over a TP group of {len(spec.sizes)} ranks (rank {spec.rank}), "
            f"but the parallel context has tp={tp_size} (rank {tp_rank}); build layers after bd.init_parallel"
        )
    if tuple(tensor.shape) != spec.local_shape:
        raise CheckpointError(
            f"parameter {name!r} has local shape {tuple(tensor.shape)}, but its layer reports {spec.local_shape}"
        )
    offsets = [0] * tensor.dim()
    offsets[spec.dim] = spec.start
    return spec.global_shape, tuple(offsets)


def model_pieces(module: nn.Module, tp_rank: int, tp_size: int) -> ModelState:
    """This rank's model tensors (parameters and persistent buffers) as boxes of global tensors."""
    specs = collect_shard_specs(module)
    pieces, aliases, canonical, non_tensor = {}, {}, {}, {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            non_tensor[name] = value  # a module's get_extra_state()
            continue
        if id(value) in canonical:  # tied weights: stored once
            aliases[name] = canonical[id(value)]
            continue
        canonical[id(value)] = name
        spec = specs.get(name)
        global_shape, offsets = _box_of(name, value, spec, tp_rank, tp_size)
        pieces[name] = Piece(f"model/{name}", value.detach(), tuple(global_shape), offsets, spec is not None,
                             None if spec is None else spec.dim)
    return ModelState(pieces, aliases, canonical, non_tensor)


def _param_name(model: ModelState, param: torch.Tensor, where: str) -> str:
    name = model.canonical.get(id(param))
    if name is None:
        raise CheckpointError(
            f"{where} holds a parameter of shape {tuple(param.shape)} that is not in the model's state_dict"
        )
    return name


def optimizer_state_piece(model: ModelState, name: str, key: str, value: torch.Tensor) -> Piece:
    """A per-parameter optimizer tensor as a box: shaped like the parameter -> sharded like it."""
    param_piece = model.pieces[name]
    if value.dim() > 0 and tuple(value.shape) == param_piece.shape:
        return Piece(f"optim/{name}/{key}", value.detach(), param_piece.global_shape, param_piece.offsets,
                     param_piece.sharded, param_piece.shard_dim)
    if param_piece.sharded and value.dim() > 0:
        raise CheckpointError(
            f"optimizer state {key!r} of sharded parameter {name!r} has shape {tuple(value.shape)}, neither the "
            f"parameter's {param_piece.shape} nor a scalar; bigdense cannot tell how it is sharded"
        )
    return Piece(f"optim/{name}/{key}", value.detach(), tuple(value.shape), (0,) * value.dim(), False)


# ---- plain torch optimizers ------------------------------------------------------------------


def torch_optimizer_pieces(optimizer: torch.optim.Optimizer, model: ModelState):
    """``(pieces, param_groups, non_tensor_state)``; param groups list parameter names."""
    groups, pieces, non_tensor = [], [], {}
    for g, group in enumerate(optimizer.param_groups):
        names = [_param_name(model, p, f"optimizer param group {g}") for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        for name, p in zip(names, group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    pieces.append(optimizer_state_piece(model, name, key, value))
                else:
                    non_tensor.setdefault(name, {})[key] = value
    return pieces, groups, non_tensor


def torch_optimizer_state_dict(optimizer: torch.optim.Optimizer, model: ModelState, groups, tensors, non_tensor):
    """The ``state_dict`` for ``optimizer.load_state_dict`` from name-keyed saved state.

    ``tensors[name][key]`` are already this rank's boxes; indices follow the optimizer's own order.
    """
    state, out_groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, groups):
        ids = []
        for p in group["params"]:
            name = model.canonical[id(p)]
            entry = {**non_tensor.get(name, {}), **tensors.get(name, {})}
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": out_groups}


def check_optimizer_groups(optimizer_groups: list[list[str]], saved_groups: list[dict]) -> None:
    """The optimizer being loaded groups the same parameters as the one that was saved."""
    if len(optimizer_groups) != len(saved_groups):
        raise CheckpointError(
            f"the optimizer has {len(optimizer_groups)} parameter groups, the checkpoint's had {len(saved_groups)}"
        )
    for g, (names, saved) in enumerate(zip(optimizer_groups, saved_groups)):
        have, want = set(names), set(saved["params"])
        if have != want:
            extra, missing = sorted(have - want), sorted(want - have)
            raise CheckpointError(
                f"optimizer param group {g} differs from the checkpoint's: "
                f"not in the checkpoint {extra[:5]}, missing from the optimizer {missing[:5]}"
            )


# ---- DeepSpeed ZeRO 1/2 (and its bf16 optimizer) ---------------------------------------------


class DeepSpeedOptimizer:
    """The parts of a DeepSpeed ZeRO-1/2 (or BF16) optimizer a checkpoint needs.

    Values go through DeepSpeed's public per-parameter API (``safe_get_full_*`` gather over DP,
    ``safe_set_full_*`` keep this DP rank's fragment). Which parameters form a group and which flat
    fp32 partition backs it are DeepSpeed attributes (``bit16_groups`` /
    ``single_partition_of_fp32_groups``, or ``bf16_groups`` / ``fp32_groups_flat_partition``).
    """

    _LAYOUTS = (("bit16_groups", "single_partition_of_fp32_groups"), ("bf16_groups", "fp32_groups_flat_partition"))
    _SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, wrapper):
        self.wrapper = wrapper
        lp_attr, hp_attr = next((lp, hp) for lp, hp in self._LAYOUTS if hasattr(wrapper, lp) and hasattr(wrapper, hp))
        self.lp_groups, self.hp_flat = getattr(wrapper, lp_attr), getattr(wrapper, hp_attr)
        self.inner = wrapper.optimizer
        self.inner_groups = self.inner.param_groups

    @classmethod
    def wraps(cls, optimizer) -> bool:
        """Whether ``optimizer`` is a DeepSpeed ZeRO-1/2 or BF16 optimizer wrapper."""
        return hasattr(optimizer, "optimizer") and any(
            hasattr(optimizer, lp) and hasattr(optimizer, hp) for lp, hp in cls._LAYOUTS
        )

    def loss_scaler_state(self) -> Optional[dict]:
        """DeepSpeed's own (fp16) loss scaler: its scale and counters, or ``None``."""
        scaler = getattr(self.wrapper, "loss_scaler", None)
        if scaler is None:
            return None
        return {k: getattr(scaler, k) for k in self._SCALER_FIELDS if hasattr(scaler, k)}

    def load_loss_scaler_state(self, state: Optional[dict]) -> None:
        scaler = getattr(self.wrapper, "loss_scaler", None)
        for k, v in (state or {}).items():
            if scaler is not None and hasattr(scaler, k):
                setattr(scaler, k, v)

    def group_names(self, model: ModelState) -> list[list[str]]:
        return [
            [_param_name(model, p, f"DeepSpeed param group {g}") for p in lps] for g, lps in enumerate(self.lp_groups)
        ]

    def pieces(self, model: ModelState):
        """Gathers every parameter's state over DP (a collective on all DP ranks, in one order)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        groups, pieces = [], []
        for g, (lps, flat) in enumerate(zip(self.lp_groups, self.hp_flat)):
            names = [_param_name(model, p, f"DeepSpeed param group {g}") for p in lps]
            groups.append({**{k: v for k, v in self.inner_groups[g].items() if k != "params"}, "params": names})
            flat_state = self.inner.state.get(flat, {})
            tensor_keys = sorted(k for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape)
            scalars = {k: v for k, v in flat_state.items() if k not in tensor_keys and torch.is_tensor(v)}
            for name, lp in zip(names, lps):
                for key in tensor_keys:
                    full = safe_get_full_optimizer_state(lp, key).to("cpu")
                    pieces.append(optimizer_state_piece(model, name, key, full))
                if lp.dtype != torch.float32:
                    master = safe_get_full_fp32_param(lp).to("cpu")
                    pieces.append(optimizer_state_piece(model, name, FP32_MASTER, master))
                for key, value in scalars.items():
                    pieces.append(optimizer_state_piece(model, name, key, value.detach().to("cpu").clone()))
        return pieces, groups

    def load(self, model: ModelState, groups, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set masters (from saved masters, else the just-loaded weights) and optimizer state."""
        from deepspeed.utils import (
            lazy_init_hp_params_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state,
        )

        for g, (lps, flat) in enumerate(zip(self.lp_groups, self.hp_flat)):
            if groups is not None:
                self.inner_groups[g].update({k: v for k, v in groups[g].items() if k != "params"})
            names = [model.canonical[id(p)] for p in lps]
            saved = [tensors.get(n, {}) for n in names]
            tensor_keys = sorted({k for s in saved for k, v in s.items() if v.dim() > 0 and k != FP32_MASTER})
            if tensor_keys:
                state = self.inner.state.setdefault(flat, {})
                fresh = any(k not in state for k in tensor_keys)
                for key in tensor_keys:
                    state.setdefault(key, torch.zeros_like(flat))
                for key in {k for s in saved for k, v in s.items() if v.dim() == 0}:
                    first = next(s[key] for s in saved if key in s)
                    state[key] = first.to(dtype=state[key].dtype if key in state else first.dtype).clone()
                if fresh:  # DeepSpeed links per-parameter views of the state after its first step
                    lazy_init_hp_params_optimizer_state(lps, flat, self.inner.state)
            for name, lp, s in zip(names, lps, saved):
                master = s.get(FP32_MASTER)
                safe_set_full_fp32_param(lp, (master if master is not None else lp.detach()).float())
                for key in tensor_keys:
                    if key in s:
                        safe_set_full_optimizer_state(lp, s[key].float(), key)


# ---- RNG ----------------------------------------------------------------------------------------


def capture_rng() -> dict:
    """This process's RNG states (torch CPU, CUDA if initialised, python, numpy), weights_only-safe."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def current_context():
    """The default parallel context, checked against torch.distributed's world."""
    from ..parallel.context import get_default_context
    from ._agree import world_size

    ctx = get_default_context()
    if ctx.world_size != world_size():
        raise CheckpointError(
            f"torch.distributed has {world_size()} ranks but the bigdense context has {ctx.world_size}; "
            f"call bd.init_parallel(tp=...) before saving or loading"
        )
    return ctx


def resolve_optimizer(optimizer, engine):
    """The optimizer to save/load: a torch optimizer, a `DeepSpeedOptimizer`, or ``None``.

    ``optimizer`` may be a torch optimizer or a DeepSpeed engine's ``optimizer`` (its ZeRO-1/2 or
    BF16 wrapper); with a DeepSpeedEngine as the model it defaults to the engine's.
    """
    if engine is not None:
        if optimizer is not None and optimizer is not engine.optimizer:
            raise TypeError("with a DeepSpeedEngine pass optimizer=None or engine.optimizer")
        optimizer = engine.optimizer
    if optimizer is None:
        return None
    if DeepSpeedOptimizer.wraps(optimizer):
        return DeepSpeedOptimizer(optimizer)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":  # its .state holds only this DP rank's part
        raise CheckpointError(
            "torch's ZeroRedundancyOptimizer is not supported by bigdense checkpoints; call its "
            "consolidate_state_dict() and save a plain optimizer, or use DeepSpeed ZeRO"
        )
    if isinstance(optimizer, torch.optim.Optimizer):  # also DeepSpeed's ZeRO stage 0 fp32 client optimizer
        return optimizer
    raise CheckpointError(
        f"optimizer {type(optimizer).__name__} is not supported by bigdense checkpoints (supported: torch "
        f"optimizers, DeepSpeed ZeRO stages 1-2 and its BF16 optimizer, stage 0 with a torch optimizer)"
    )
