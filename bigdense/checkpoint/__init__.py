"""Sharded checkpoints, resharding, dense export/import and parallelize().

    bd.save_checkpoint("runs/x/step_1000", model, optimizer, scheduler=sched, extra={"data_pos": pos})
    info = bd.load_checkpoint("runs/x/latest", model, optimizer, scheduler=sched)   # at any tp / dp
    bd.export_dense("runs/x/latest", "model.safetensors")   # one unsharded file, plain nn.Module names
    model = bd.parallelize(plain_model, plan=None)          # nn.Linear/nn.Embedding -> bigdense layers

See `bigdense.checkpoint.format` for the on-disk layout.
"""
from .dense import export_dense, load_dense_state_dict
from .format import CheckpointError
from .load import CheckpointInfo, load_checkpoint
from .parallelize import ShardedDropout, parallelize, plan_parallelism
from .save import save_checkpoint

__all__ = [
    "save_checkpoint", "load_checkpoint", "CheckpointInfo", "CheckpointError", "export_dense",
    "load_dense_state_dict", "parallelize", "plan_parallelism", "ShardedDropout",
]
