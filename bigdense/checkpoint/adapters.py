"""`resolve_optimizer`: the `OptimizerAdapter` that saves and loads a given optimizer -- torch's,
DeepSpeed's ZeRO-1/2 and BF16 wrappers, its stage-0 optimizers, and a DeepSpeed engine's pair with
bigdense's optimizer of world-sharded parameters. The one place that tells optimizers apart: save and
load only talk to the adapter's interface (`bigdense.checkpoint.optimizer`), which also says which
algorithm's state each holds (`optimizer.algorithm_of`)."""
from __future__ import annotations

from typing import Optional

import torch

from .format import CheckpointError
from .optimizer import OptimizerAdapter, TorchOptimizerState
from .split import OptimizerPair, SplitOptimizerState, WorldShardedState
from .zero import UnfusedMastersState, ZeroOptimizerState


def resolve_optimizer(optimizer, engine) -> Optional[OptimizerAdapter]:
    """The adapter of the optimizer to save/load, or ``None``.

    ``optimizer`` may be a torch optimizer or a DeepSpeed engine's ``optimizer`` (its ZeRO-1/2 or
    BF16 wrapper); with a DeepSpeedEngine as the model it defaults to the engine's. A bigdense
    `DSEngine` or `FSDPEngine` with world-sharded parameters hands an ``OptimizerPair`` (its
    ``checkpoint_state``): its main optimizer and the one stepping those parameters, saved as one.
    """
    if isinstance(optimizer, OptimizerPair):
        world = optimizer.world
        world_state = TorchOptimizerState(world) if isinstance(world, torch.optim.Optimizer) else WorldShardedState(world)
        return SplitOptimizerState(resolve_optimizer(optimizer.deepspeed, engine), world_state,
                                   optimizer.deepspeed_from, optimizer.world_from)
    if engine is not None:
        if optimizer is not None and optimizer is not engine.optimizer:
            raise TypeError("with a DeepSpeedEngine pass optimizer=None or engine.optimizer")
        optimizer = engine.optimizer
    if optimizer is None:
        return None
    if ZeroOptimizerState.wraps(optimizer):
        return ZeroOptimizerState(optimizer)
    if UnfusedMastersState.wraps(optimizer):
        return UnfusedMastersState(optimizer)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":  # its .state holds only this DP rank's part
        raise CheckpointError(
            "torch's ZeroRedundancyOptimizer is not supported by bigdense checkpoints; call its "
            "consolidate_state_dict() and save a plain optimizer, or use DeepSpeed ZeRO"
        )
    if isinstance(optimizer, torch.optim.Optimizer):  # also DeepSpeed's ZeRO stage 0 fp32 client optimizer
        return TorchOptimizerState(optimizer)
    raise CheckpointError(
        f"optimizer {type(optimizer).__name__} is not supported by bigdense checkpoints (supported: torch "
        f"optimizers, DeepSpeed ZeRO stages 1-2 and its BF16 optimizer, and its stage-0 optimizers)"
    )
