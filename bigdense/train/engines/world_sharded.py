"""The optimizer of parameters split over every rank (a world-sharded head) beside DeepSpeed's.

DeepSpeed's only notion of parameters that are not DP replicas is MoE experts, which it averages
over a DP group of its own; a world-sharded parameter has no replicas at all, and its layer already
produces the gradient DDP's averaging would give a TP-sharded head. So `DSEngine` keeps these
parameters away from DeepSpeed (out of its optimizer, its start-up broadcast and its stage-0
all-reduce: `ds_compat.initialize`, `keep_out_of_dp_reduction`) and steps them here: torch's AdamW
with DeepSpeed's hyper-parameters, groups and learning rate, fp32 master copies when DeepSpeed
made the module bf16/fp16, clipped by the one global norm (bigdense's at stage 0, ZeRO's made
global by `ds_compat.add_to_norm` at stages 1-2), and skipped whenever DeepSpeed skips its step
(`ds_compat.skip_when` makes it skip for these parameters' gradients too).
"""
from __future__ import annotations

import torch

from ...parallel.sharding import is_world_sharded


def split_world_sharded(groups: list[dict]) -> tuple[list[dict], list[int], list[dict], list[int]]:
    """``param_groups``' groups split into (DeepSpeed's groups, the index each came from, the
    world-sharded groups, the index each came from); empty groups are dropped (DeepSpeed cannot
    flatten one)."""
    rest, rest_from, world, world_from = [], [], [], []
    for index, group in enumerate(groups):
        for wanted, out, origin in ((False, rest, rest_from), (True, world, world_from)):
            params = [p for p in group["params"] if is_world_sharded(p) == wanted]
            if params:
                out.append({**group, "params": params})
                origin.append(index)
    return rest, rest_from, world, world_from


class WorldShardedAdamW:
    """torch's AdamW over the world-sharded parameters, with fp32 masters for bf16/fp16 ones.

    ``params`` are the module's parameters; ``masters`` what AdamW steps (the parameters themselves
    when fp32). Per step: `take_grads` before DeepSpeed's step (DeepSpeed clears every module
    gradient in its step), `step` after it.
    """

    def __init__(self, groups: list[dict], **adamw):
        self.params = [p for g in groups for p in g["params"]]
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
                        for p in self.params]
        masters = iter(self.masters)
        self.optimizer = torch.optim.AdamW(
            [{**g, "params": [next(masters) for _ in g["params"]]} for g in groups], **adamw)
        self._grads: list[torch.Tensor] = []

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params + self.masters:
            p.grad = None
        self._grads = []

    def take_grads(self) -> None:
        """Take the accumulated gradients off the module (DeepSpeed's step clears every module
        gradient at ZeRO stage 0), as fp32 tensors for the masters."""
        self._grads = []
        for p in self.params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = None
            self._grads.append(grad.float())

    @torch.no_grad()
    def step(self, lr: float, grad_factor=None) -> None:
        """One AdamW step at ``lr`` on the taken gradients times ``grad_factor`` (what DeepSpeed's
        step multiplied its own by, to unscale and clip; ``None``: nothing), then the module's
        copies from the masters."""
        if grad_factor is not None and self._grads:
            torch._foreach_mul_(self._grads, grad_factor)
        for master, grad in zip(self.masters, self._grads):
            master.grad = grad
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            if p is not master:
                p.copy_(master)
