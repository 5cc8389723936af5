"""DeepSpeed's optimizers behind the `OptimizerAdapter` interface: ZeRO-1/2 (and its BF16
optimizer), and the stage-0 optimizer of bf16/fp16 weights (`UnfusedMastersState`).

Saving writes this DP rank's own partition and gathers nothing: each parameter's fragment in the
flat fp32 partition (master weights and each optimizer tensor) is a contiguous range of the
flattened parameter, stored as the boxes of that range (`format.flat_range_boxes`), so readers at
any layout -- plain optimizers included -- assemble a parameter's state from the fragments every
DP rank wrote. Loading goes through DeepSpeed's public per-parameter API (``safe_set_full_*``
keeps this DP rank's fragment of each full tensor).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import ds_state
from .boxes import flat_range_boxes, narrow_box
from .optimizer import (
    FP32_MASTER, OptimizerAdapter, TorchOptimizerState, saved_group_with_running_switches, saved_groups_without_params,
)
from .pieces import ModelState, Piece, optimizer_state_piece, param_name


class ZeroOptimizerState(OptimizerAdapter):
    """The parts of a DeepSpeed ZeRO-1/2 (or BF16) optimizer a checkpoint needs. Where DeepSpeed
    keeps them has no public API: `ds_state` reads it (DeepSpeed workaround 7)."""

    kind = "deepspeed"

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.lp_groups, self.hp_flat = ds_state.zero_layout(wrapper)
        self.inner = wrapper.optimizer
        self.inner_groups = self.inner.param_groups

    @classmethod
    def wraps(cls, optimizer) -> bool:
        """Whether ``optimizer`` is a DeepSpeed ZeRO-1/2 or BF16 optimizer wrapper."""
        return ds_state.zero_layout(optimizer) is not None

    def group_names(self, model: ModelState) -> list[list[str]]:
        return [
            [param_name(model, p, f"DeepSpeed param group {g}") for p in lps] for g, lps in enumerate(self.lp_groups)
        ]

    def common(self, model: ModelState) -> dict:
        groups = [{**g, "params": n}
                  for g, n in zip(saved_groups_without_params(self.inner_groups), self.group_names(model))]
        return {"param_groups": groups, "loss_scaler": ds_state.loss_scaler_state(self.wrapper)}
    def pieces(self, model: ModelState) -> list[Piece]:
        """This DP rank's fragments of every parameter's state (no collective), plus the scalars
        (step counters), which every DP rank holds alike."""
        out = []
        for names, lps, flat in zip(self.group_names(model), self.lp_groups, self.hp_flat):
            flat_state = self.inner.state.get(flat, {})
            tensor_keys = sorted(k for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape)
            scalars = {k: v for k, v in flat_state.items() if k not in tensor_keys and torch.is_tensor(v)}
            for name, lp in zip(names, lps):
                sources = {key: flat_state[key] for key in tensor_keys}
                if lp.dtype != torch.float32:
                    sources[FP32_MASTER] = flat
                out += self._fragment_pieces(model, name, lp, sources)
                out += [optimizer_state_piece(model, name, key, value.detach().to("cpu").clone())
                        for key, value in scalars.items()]
        return out

    @staticmethod
    def _fragment_pieces(model: ModelState, name: str, lp, sources: dict[str, torch.Tensor]) -> list[Piece]:
        fragment_at = ds_state.zero_fragment(lp)
        if fragment_at is None:
            return []
        param = model.pieces[name]
        start, numel, hp_start = fragment_at
        out = []
        for key, flat in sources.items():
            fragment = flat.detach().narrow(0, hp_start, numel)
            for off, shape, flat_start in flat_range_boxes(param.shape, start, start + numel):
                box = fragment.narrow(0, flat_start - start, torch.Size(shape).numel()).view(shape)
                for local_off, global_off, part in param.to_global(off, shape):  # several for a packed parameter
                    out.append(Piece(f"optim/{name}/{key}", narrow_box(box, off, local_off, part), param.global_shape,
                                     global_off, param.sharded, param.shard_dim, dp_owned=True))
        return out

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set masters (from saved masters, else the just-loaded weights) and optimizer state."""
        from deepspeed.utils import (
            lazy_init_hp_params_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state,
        )

        groups = None if common is None else saved_groups_without_params(common["param_groups"])
        for g, (lps, flat) in enumerate(zip(self.lp_groups, self.hp_flat)):
            if groups is not None:
                self.inner_groups[g].update(saved_group_with_running_switches(groups[g], self.inner_groups[g]))
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
        if common is not None:
            ds_state.load_loss_scaler_state(self.wrapper, common.get("loss_scaler"))


class UnfusedMastersState(TorchOptimizerState):
    """DeepSpeed's optimizer for bf16/fp16 weights without ZeRO (stage 0): a torch optimizer over
    one fp32 master per parameter, each mirroring a low-precision module parameter. Saved as that
    torch optimizer's state plus each master under ``fp32_master`` -- what ZeRO saves -- so either
    loads into the other, and into plain optimizers. Where DeepSpeed keeps the pairs has no public
    API: `ds_state` reads it (DeepSpeed workaround 7)."""

    kind = "deepspeed"

    def __init__(self, wrapper):
        super().__init__(wrapper.optimizer)
        self.wrapper = wrapper
        self.pairs = [list(zip(lps, hps)) for lps, hps in zip(*ds_state.unfused_masters(wrapper))]
        self.lp_of = {id(hp): lp for group in self.pairs for lp, hp in group}

    @classmethod
    def wraps(cls, optimizer) -> bool:
        return ds_state.unfused_masters(optimizer) is not None

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        return self.lp_of[id(p)]

    def pieces(self, model: ModelState) -> list[Piece]:
        masters = [optimizer_state_piece(model, param_name(model, lp, "the optimizer"), FP32_MASTER, hp)
                   for group in self.pairs for lp, hp in group]
        return super().pieces(model) + masters

    def common(self, model: ModelState) -> dict:
        return {**super().common(model), "loss_scaler": ds_state.loss_scaler_state(self.wrapper)}

    def loads_key(self, key: str) -> bool:
        return True

    def load(self, model: ModelState, common: Optional[dict], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Optimizer state as a torch optimizer's; masters from the saved masters, else from the
        just-loaded weights."""
        super().load(model, common, {n: {k: v for k, v in t.items() if k != FP32_MASTER} for n, t in tensors.items()})
        with torch.no_grad():
            for group in self.pairs:
                for lp, hp in group:
                    master = tensors.get(model.canonical[id(lp)], {}).get(FP32_MASTER)
                    hp.copy_(master if master is not None else lp.detach())
        if common is not None:
            ds_state.load_loss_scaler_state(self.wrapper, common.get("loss_scaler"))
