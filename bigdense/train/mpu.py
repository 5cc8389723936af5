"""bigdense's TP x DP mesh in the shape of DeepSpeed's model-parallel unit (``mpu=``).

DeepSpeed asks the ``mpu`` for the model-parallel group (to sum gradient norms and overflow flags
across tensor shards; it counts a gradient on every TP rank only when its parameter has
``tensor_model_parallel``, which bigdense layers set, and replicated ones on TP rank 0 only) and for
the data-parallel group (ZeRO partitions optimizer state and gradients over it, and averages
gradients over it). bigdense has no pipeline stages, so "model parallel" is TP exactly.

Only the methods DeepSpeed 0.19.8 calls are provided. The sequence-parallel methods are left out on
purpose: DeepSpeed switches to different group logic when ``initialize_sequence_parallel`` exists.
"""
from __future__ import annotations

from ..parallel.context import ParallelContext


class DeepSpeedMPU:
    def __init__(self, ctx: ParallelContext):
        if not ctx.is_distributed or ctx.tp_group is None or ctx.dp_group is None:
            raise ValueError(
                "DeepSpeedMPU: the parallel context has no process groups (a single process without a launcher); "
                "engine.kind=deepspeed needs torch.distributed -- launch with torchrun or deepspeed, "
                "even for one process"
            )
        self.ctx = ctx

    # model parallel == tensor parallel (no pipeline)
    def get_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size

    def get_model_parallel_group(self):
        return self.ctx.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size

    def get_tensor_model_parallel_group(self):
        return self.ctx.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this rank's TP group (the mesh puts TP innermost)."""
        return self.ctx.dp_rank * self.ctx.tp_size

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_size

    def get_data_parallel_group(self):
        return self.ctx.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return [d * self.ctx.tp_size + self.ctx.tp_rank for d in range(self.ctx.dp_size)]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
