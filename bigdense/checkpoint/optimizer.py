"""Optimizer state in a checkpoint: one adapter interface for every kind of optimizer.

`save.py` and `load.py` talk to an `OptimizerAdapter` only; `adapters.resolve_optimizer` picks the adapter:
`TorchOptimizerState` for any ``torch.optim.Optimizer`` (also DeepSpeed's stage-0 client
optimizer), `bigdense.checkpoint.zero.ZeroOptimizerState` for DeepSpeed ZeRO-1/2 and its BF16
optimizer, `bigdense.checkpoint.zero.UnfusedMastersState` for its stage-0 bf16/fp16 optimizer. Both store the same thing -- per-parameter tensors under ``optim/<param name>/<key>``
and parameter groups listing parameter names -- so state saved by either kind loads into the other.

What the state *means* is the algorithm's: every adapter records it (`algorithm_of`: ``"muon"`` for
`bigdense.muon.Muon`, ``"adamw"`` for every other optimizer), the manifest keeps it, and
`check_optimizer_algorithm` refuses a load into a run of another one before anything is changed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..parallel.sharding import is_dtensor, local_tensor
from .format import CheckpointError
from .pieces import ModelState, Piece, optimizer_state_piece, param_name

FP32_MASTER = "fp32_master"  # optimizer-state key under which DeepSpeed's fp32 master weights are kept


class OptimizerAdapter:
    """What a checkpoint needs from an optimizer.

    ``kind`` (who keeps the state: torch, DeepSpeed) and ``algorithm`` (what the state is:
    `algorithm_of`) are recorded in the manifest. `pieces` are this rank's per-parameter tensors
    (sharded like their parameters where shaped like them); `common` is the replicated rest (parameter
    groups by name, hyper-parameters, non-tensor state). `group_names` lists the parameters of each
    group, to check a checkpoint's groups against; `loads_key` says which stored state keys this
    kind takes; `load` puts ``tensors[param name][key]`` (this rank's boxes) and ``common`` back
    (``common=None``: only bring derived state, such as fp32 masters, in line with the weights).
    """

    kind: str
    algorithm: str = "adamw"  # DeepSpeed's wrappers: bigdense builds them over AdamW only

    def group_names(self, model: ModelState) -> list[list[str]]:
        raise NotImplementedError

    def pieces(self, model: ModelState) -> list[Piece]:
        raise NotImplementedError

    def common(self, model: ModelState) -> dict:
        raise NotImplementedError

    def loads_key(self, key: str) -> bool:
        return True

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        raise NotImplementedError


# optim.name -> the name messages give it; the state each keeps says why one cannot go on from the other's.
ALGORITHMS = {
    "adamw": ("AdamW", "two moments and a step count per parameter"),
    "muon": ("Muon", "a momentum buffer per dense-layer weight, AdamW's moments for the other parameters"),
}
LEGACY_ALGORITHM = "adamw"  # checkpoints written before the manifest recorded the algorithm: all AdamW's


def algorithm_of(optimizer) -> str:
    """The algorithm of a torch optimizer's state, as ``optim.name`` spells it: its ``algorithm``
    attribute (`bigdense.muon.Muon`'s is ``"muon"``), else ``"adamw"`` -- every other
    optimizer bigdense builds is torch's AdamW, and a user's own optimizer is taken for one too."""
    return str(getattr(optimizer, "algorithm", "adamw"))


def check_optimizer_algorithm(ckpt, saved: Optional[str], running: str) -> None:
    """The optimizer being loaded runs the algorithm whose state the checkpoint holds (``saved``:
    the manifest's ``optimizer_algorithm``, None in checkpoints older than the record). Param groups
    and state keys could line up anyway (a tensor shaped like its weight is sharded alike whatever it
    means), so the algorithm is compared by name, before anything is loaded."""
    saved = LEGACY_ALGORITHM if saved is None else str(saved)
    if saved == running:
        return
    theirs, ours = (ALGORITHMS.get(a, (a, None)) for a in (saved, running))
    kept = "; ".join(f"{name} keeps {what}" for name, what in (theirs, ours) if what)
    raise CheckpointError(
        f"{ckpt}: the checkpoint's optimizer state is {theirs[0]}'s (optim.name={saved}); this run's optimizer is "
        f"{ours[0]} (optim.name={running}), which cannot go on from it{f' ({kept})' if kept else ''}. To switch, "
        f"start from the weights only with trainer.init_from={ckpt} (a fresh {ours[0]}; in code: "
        f"bd.load_checkpoint(..., optimizer=None)), or keep optim.name={saved}"
    )


# Param-group keys that say how an optimizer computes, not what it computes: a loaded checkpoint
# keeps the running optimizer's (a run with trainer.cuda_graphs needs capturable=True whatever saved it).
IMPLEMENTATION_SWITCHES = ("fused", "foreach", "capturable", "differentiable")


def saved_groups_without_params(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def saved_group_with_running_switches(saved: dict, running: dict) -> dict:
    """A saved param group's hyper-parameters with the running group's `IMPLEMENTATION_SWITCHES`:
    how the step runs is this run's choice, whichever engine wrote the checkpoint."""
    kept = {k: running[k] for k in IMPLEMENTATION_SWITCHES if k in running}
    return {**{k: v for k, v in saved.items() if k not in IMPLEMENTATION_SWITCHES}, **kept}


class TorchOptimizerState(OptimizerAdapter):
    """A plain ``torch.optim.Optimizer``: state by parameter, groups by parameter name."""

    kind = "torch"

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.algorithm = algorithm_of(optimizer)

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter that the optimizer's tensor ``p`` stands for (itself here)."""
        return p

    def group_names(self, model: ModelState) -> list[list[str]]:
        return [[param_name(model, self.model_param(p), f"optimizer param group {g}") for p in group["params"]]
                for g, group in enumerate(self.optimizer.param_groups)]

    def pieces(self, model: ModelState) -> list[Piece]:
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = param_name(model, self.model_param(p), "the optimizer")
                out += [optimizer_state_piece(model, name, key, value)
                        for key, value in self.optimizer.state.get(p, {}).items() if isinstance(value, torch.Tensor)]
        return out

    def common(self, model: ModelState) -> dict:
        names = self.group_names(model)
        groups = [{**g, "params": n} for g, n in zip(saved_groups_without_params(self.optimizer.param_groups), names)]
        non_tensor: dict = {}
        for group, group_names in zip(self.optimizer.param_groups, names):
            for name, p in zip(group_names, group["params"]):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        non_tensor.setdefault(name, {})[key] = value
        return {"param_groups": groups, "non_tensor_state": non_tensor}

    def loads_key(self, key: str) -> bool:
        return key != FP32_MASTER  # DeepSpeed's fp32 master weights mean nothing to a plain optimizer

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """``load_state_dict`` with indices in this optimizer's own order."""
        if common is None:
            return
        non_tensor = common.get("non_tensor_state", {})
        state, out_groups, index = {}, [], 0
        for group, saved in zip(self.optimizer.param_groups, saved_groups_without_params(common["param_groups"])):
            ids = []
            for p in group["params"]:
                name = model.canonical[id(self.model_param(p))]
                entry = {**non_tensor.get(name, {}), **{k: _sharded_like(v, p) for k, v in tensors.get(name, {}).items()}}
                if entry:
                    state[index] = entry
                ids.append(index)
                index += 1
            out_groups.append({**saved_group_with_running_switches(saved, group), "params": ids})
        self.optimizer.load_state_dict({"state": state, "param_groups": out_groups})


def _sharded_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor shaped like an FSDP-sharded parameter's local slice, made a DTensor
    placed like the parameter (AdamW's moments of a DTensor are DTensors)."""
    if not is_dtensor(param) or value.dim() == 0 or value.shape != local_tensor(param).shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


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
