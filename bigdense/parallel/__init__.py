"""Process groups, collectives, autograd communication regions and TP-invariant randomness."""
from .context import (
    ParallelContext,
    ParallelDims,
    destroy_parallel,
    get_default_context,
    init_parallel,
    set_default_context,
)
from .comm import CollectiveCounts, count_collectives
from .partial_grads import deferred_partial_grad_sums, partial_grad_params, sum_partial_grads_
from .dropout import batch_slice, tp_dropout
from .regions import (
    copy_to_tp, gather_batch_from_dp, gather_from_sequence, gather_from_tp, gather_sequence_shares, reduce_from_tp,
    reduce_scatter_to_sequence, scatter_to_sequence, scatter_to_tp,
)
from .schedule import ScheduleMismatch, check_schedule
from .sharding import ShardSpec, shard_range, shard_sizes

__all__ = [
    "ParallelContext", "ParallelDims", "init_parallel", "destroy_parallel", "get_default_context",
    "set_default_context", "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "gather_batch_from_dp",
    "gather_from_sequence", "reduce_scatter_to_sequence", "scatter_to_sequence", "gather_sequence_shares",
    "count_collectives", "CollectiveCounts",
    "ShardSpec", "shard_sizes", "shard_range", "tp_dropout", "batch_slice", "deferred_partial_grad_sums",
    "partial_grad_params", "sum_partial_grads_", "check_schedule", "ScheduleMismatch",
]
