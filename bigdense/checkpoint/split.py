"""A model's AdamW split over two optimizers, saved as one: DeepSpeed's (or the FSDP engine's, over
FSDP's DTensors), and the one of the parameters split over every rank (bigdense's
`WorldShardedAdamW`, `bigdense.train.engines.world_sharded`, or a torch AdamW).

The checkpoint holds what one AdamW over ``param_groups`` would hold -- the same groups by parameter
name, the same per-parameter state, DeepSpeed-style ``fp32_master`` for bf16/fp16 parameters -- so
it loads into the DDP engine (or a plain AdamW) and back, at any layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .optimizer import FP32_MASTER, OptimizerAdapter, TorchOptimizerState
from .pieces import ModelState, Piece, optimizer_state_piece, param_name


class WorldShardedState(TorchOptimizerState):
    """`WorldShardedAdamW`: its AdamW's state under the module's parameter names, plus the fp32
    masters of bf16/fp16 parameters (loaded from the checkpoint's, else from the weights)."""

    def __init__(self, world):
        super().__init__(world.optimizer)
        self.world = world
        self._param_of = {id(m): p for p, m in zip(world.params, world.masters)}

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        return self._param_of[id(p)]

    def _distinct_masters(self):
        return [(p, m) for p, m in zip(self.world.params, self.world.masters) if p is not m]

    def pieces(self, model: ModelState) -> list[Piece]:
        masters = [optimizer_state_piece(model, param_name(model, p, "the world-sharded optimizer"), FP32_MASTER,
                                         m.detach()) for p, m in self._distinct_masters()]
        return super().pieces(model) + masters

    def loads_key(self, key: str) -> bool:
        return key != FP32_MASTER or bool(self._distinct_masters())

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        state = {name: {k: v for k, v in entry.items() if k != FP32_MASTER} for name, entry in tensors.items()}
        super().load(model, common, state)
        with torch.no_grad():
            for p, m in self._distinct_masters():
                saved = tensors.get(model.canonical[id(p)], {}).get(FP32_MASTER)
                m.copy_(saved if saved is not None else p)


class SplitOptimizerState(OptimizerAdapter):
    """Two adapters over disjoint parameters, saved and loaded as one optimizer; ``*_from`` give
    the group of the whole that each of their groups belongs to. Its kind and algorithm are the main
    optimizer's: the world-sharded parameters' AdamW is what AdamW and Muon alike run for them."""

    def __init__(self, main: OptimizerAdapter, world: OptimizerAdapter, main_from: list[int], world_from: list[int]):
        self.parts = ((main, list(main_from)), (world, list(world_from)))
        self.kind, self.algorithm = main.kind, main.algorithm
        self.n_groups = max(main_from + world_from) + 1

    def group_names(self, model: ModelState) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in range(self.n_groups)]
        for adapter, origin in self.parts:
            for g, names in zip(origin, adapter.group_names(model)):
                out[g] += names
        return out

    def pieces(self, model: ModelState) -> list[Piece]:
        return [piece for adapter, _ in self.parts for piece in adapter.pieces(model)]

    def common(self, model: ModelState) -> dict:
        merged: dict = {}
        groups: list[Optional[dict]] = [None] * self.n_groups
        non_tensor: dict = {}
        for adapter, origin in reversed(self.parts):  # the main optimizer's hyper-parameters win
            part = adapter.common(model)
            non_tensor.update(part.get("non_tensor_state", {}))
            merged.update(part)
            for g, group in zip(origin, part["param_groups"]):
                groups[g] = {**group, "params": (groups[g] or {"params": []})["params"] + group["params"]}
        return {**merged, "param_groups": groups, "non_tensor_state": non_tensor}

    def loads_key(self, key: str) -> bool:
        return any(adapter.loads_key(key) for adapter, _ in self.parts)

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        for adapter, origin in self.parts:
            names = adapter.group_names(model)
            part = None
            if common is not None:
                part = {**common, "param_groups": [{**common["param_groups"][g], "params": n}
                                                   for g, n in zip(origin, names)]}
            mine = {name: {k: v for k, v in tensors.get(name, {}).items() if adapter.loads_key(k)}
                    for group in names for name in group}
            adapter.load(model, part, mine)


@dataclass
class OptimizerPair:
    """What `DSEngine.checkpoint_state` (and `FSDPEngine`'s) hands ``bd.save_checkpoint``/``load_checkpoint``
    as the optimizer when some parameters are world-sharded: DeepSpeed's optimizer (the FSDP
    engine's main AdamW) and `bigdense.train.engines.world_sharded.WorldShardedAdamW` (a torch AdamW),
    saved as the one AdamW of ``param_groups`` (``*_from``: the group each of theirs came from), so
    the checkpoint loads into the DDP engine and back."""

    deepspeed: Any  # the main optimizer: DeepSpeed's, or a torch optimizer
    world: Any  # bigdense.train.engines.world_sharded.WorldShardedAdamW, or a torch optimizer
    deepspeed_from: list[int]
    world_from: list[int]
