"""`FSDPEngine`: PyTorch FSDP2 (``fully_shard``) over the DP dimension of the TP x DP mesh.

Tensor parallelism splits each large weight over the TP group; FSDP then splits every TP-local
tensor again, along dim 0, over the DP group, so each rank holds about 1/(tp x dp) of every
parameter, gradient and AdamW moment (torchtitan's recipe: TP inside a node, FSDP across nodes).
`apply_fsdp` is the one place the sharding is applied, after TP, ``torch.compile`` and activation
checkpointing (`bigdense.jobs.parallelize`); the rest of the step is the DDP engine's
(`DDPEngine`): precision, the deferred partial-gradient sums of sequence parallelism, one global
norm and clip, one skip vote, fused AdamW with the LR on the device, no host sync.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from ...checkpoint.split import OptimizerPair
from ...errors import ConfigError, check_positive_int
from ...models.units import edge_units
from ...parallel.sharding import is_world_sharded
from ..precision import compute_dtype
from .base import EngineSettings
from .ddp import DDPEngine
from .world_sharded import split_world_sharded

# A layer attaches its shard spec to its parameters (`parallel.sharding.mark_sharded`); fully_shard
# registers new Parameter objects, to which `apply_fsdp` copies every such attribute but these.
_SKIP_ATTRIBUTES = ("_is_param",)


class FSDPEngine(DDPEngine):
    """FSDP2 over ``ctx.dp_group`` (HSDP with ``engine.dp_replicate`` > 1) + the DDP engine's step.

    Parameters: after `apply_fsdp` each is a DTensor sharded along dim 0 over the DP mesh (its
    local tensor a slice of the TP-local tensor); FSDP all-gathers a unit's parameters before its
    forward (and again before its backward when ``engine.reshard_after_forward``), and
    reduce-scatters its gradients after its backward, averaged over DP. On gloo the average is
    taken as a sum and a division (``set_force_sum_reduction_for_comms``), whatever the torch
    version: FSDP2's ``AVG`` reduce-scatter was reported to sum there (pytorch#162338), and
    `tests/test_fsdp.py` pins the average against DDP. Micro-batches but
    the last run with ``set_requires_gradient_sync(False)``: FSDP keeps the unsharded gradients
    and reduce-scatters once per step.

    Precision: ``bf16``/``fp16`` make FSDP all-gather the parameters in that dtype for compute
    (``MixedPrecisionPolicy(param_dtype)``), reduce gradients in fp32 and keep fp32 sharded
    parameters, gradients and AdamW state (the masters); the forward also runs under autocast, so
    the modules FSDP does not manage (a world-sharded head) and fp32-policy ops behave as in the DDP
    engine. fp16's `DynamicLossScaler` unscales each rank's gradient shards and votes over the
    whole mesh: a sharded grad scaler.

    Parameters split over every rank (a world-sharded head) are left to their layer (FSDP's
    ``ignored_params``), as DDP leaves them. In a single process the model is left as it is.
    """

    kind = "fsdp"

    @classmethod
    def check_config(cls, settings: EngineSettings, device_type: str) -> None:
        check_positive_int("engine.dp_replicate", settings.engine.dp_replicate, ConfigError)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            fully_shard = None
        if fully_shard is None or "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise ConfigError(f"engine=fsdp needs FSDP2's fully_shard with ignored_params (torch 2.7 or later); "
                              f"this torch is {torch.__version__}: upgrade it, or use engine=ddp")

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        mesh = dp_mesh(self.ctx, int(self.settings.engine.dp_replicate))
        if mesh is not None:
            apply_fsdp(model, mesh, reshard_after_forward=bool(self.settings.engine.reshard_after_forward),
                       param_dtype=compute_dtype(self.precision_name))
            if dist.get_backend(self.ctx.dp_group) == "gloo" and hasattr(model, "set_force_sum_reduction_for_comms"):
                model.set_force_sum_reduction_for_comms(True)  # a sum and a division: an average on any torch
        return model

    def _optimizer_over(self, groups: list[dict]) -> torch.optim.Optimizer:
        register_tensor_lr_meta()
        # One fused AdamW call cannot mix DTensors with plain tensors: the parameters FSDP left
        # alone (world-sharded) get an AdamW of their own, stepped with the same LR and skip flag,
        # and saved with the other as one (`checkpoint_state`). (They are never Muon's.)
        groups, self._groups_from, left_alone, self._left_alone_from = split_world_sharded(groups)
        self._left_alone = self._adamw(left_alone) if left_alone else None
        return super()._optimizer_over(groups)

    def _dp_shard(self) -> int:
        if not hasattr(self.model, "set_requires_gradient_sync"):  # a single process: FSDP not applied
            return 1
        return self.ctx.dp_size // int(self.settings.engine.dp_replicate)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] + ([self._left_alone] if self._left_alone is not None else [])

    def _gradient_sync(self, last: bool):
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP applied
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def checkpoint_state(self) -> dict:
        state = super().checkpoint_state()
        if self._left_alone is not None:
            state["optimizer"] = OptimizerPair(self.optimizer, self._left_alone, self._groups_from,
                                               self._left_alone_from)
        return state


_TENSOR_LR_OPS = ("_fused_adamw_.tensor_lr", "_fused_adam_.tensor_lr")
_meta_library = None


def register_tensor_lr_meta() -> None:
    """Give fused Adam(W) with a tensor LR the meta kernel torch 2.13 lacks (it has one for a float LR).

    The engines hand fused AdamW its LR as a device tensor (no host sync). With DTensor parameters,
    DTensor works out the op's output once per set of shapes by running it under FakeTensorMode,
    which -- with no meta kernel -- runs the real kernel on zero-filled tensors of the *global*
    shapes: parameters, gradients and both moments of the whole TP-local model at once, on the first
    step (measured: 4 x 64 MiB for one 4096 x 4096 weight sharded over 2 ranks). The op updates its
    inputs in place and returns nothing, so its meta kernel does nothing. `tests/test_fsdp.py` pins it.
    """
    global _meta_library
    missing = [op for op in _TENSOR_LR_OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "Meta")]
    if not missing:
        return
    _meta_library = _meta_library or torch.library.Library("aten", "IMPL")
    for op in missing:
        _meta_library.impl(op, _updates_in_place, "Meta")


def _updates_in_place(*args, **kwargs) -> None:
    return None


def dp_mesh(ctx, replicate: int):
    """The DP part of the mesh FSDP shards over: ``ctx.mesh["dp"]``, or with ``replicate`` > 1 a 2-D
    ``(dp_replicate, dp_shard)`` mesh (HSDP: sharded within a group of ``dp / replicate`` ranks,
    replicated across the groups). ``None`` in a single process."""
    if ctx.mesh is None:
        return None
    if ctx.dp_size % replicate:
        raise ConfigError(f"engine.dp_replicate={replicate} must divide the DP size ({ctx.dp_size}): FSDP shards "
                          f"over dp / dp_replicate ranks and replicates over dp_replicate groups of them")
    if replicate == 1:
        return ctx.mesh["dp"]
    from torch.distributed.device_mesh import init_device_mesh

    # The same rank order as ctx's (dp, tp) mesh, with dp split into (replicate, shard).
    mesh = init_device_mesh(ctx.device.type, (replicate, ctx.dp_size // replicate, ctx.tp_size),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return mesh["dp_replicate", "dp_shard"]


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype = torch.float32) -> None:
    """Shard ``model`` with ``fully_shard`` over ``mesh`` (1-D: FSDP; 2-D: HSDP), in this order:

    1. each transformer block (``model.blocks``): one all-gather and one reduce-scatter per block;
    2. the modules before the blocks (embeddings) and 3. those after them (final norm and head), as
       the model's ``edges()`` names them -- one unit when they share a parameter (tied embeddings:
       `bigdense.models.units.edge_units`);
    4. the root, which takes every parameter left.

    Parameters split over every rank stay out (``ignored_params``). The new parameters keep the
    attributes the layers gave the old ones (shard specs).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    attributes = {name: _attributes(p) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                  reduce_dtype=torch.float32)
    ignored = {p for p in model.parameters() if is_world_sharded(p)}

    def shard(unit, reshard: bool = reshard_after_forward) -> None:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored or None)

    for block in getattr(model, "blocks", None) or []:
        shard(block)
    for unit in edge_units(model):
        shard(unit)
    shard(model, reshard=False)  # the root's parameters are used last in forward, first in backward
    for name, p in model.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(p, key, value)


def _attributes(p: torch.Tensor) -> dict:
    return {k: v for k, v in vars(p).items() if k not in _SKIP_ATTRIBUTES}


__all__ = ["FSDPEngine", "apply_fsdp", "dp_mesh"]
