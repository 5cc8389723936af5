"""Making a trained dense layer smaller: low-rank factors, pruning, sparse products, int8 weights.

Every tool here takes the tensor-parallel layers of `bigdense.layers` (or a converted model's) as
they are sharded and keeps their promises: the same numbers on every layout, no rank left waiting.

* `lowrank` (`bd.low_rank`): a dense layer replaced by its truncated-SVD pair, from the randomised
  SVD of the sharded weight (`svd`);
* `pruning` (`bd.prune`): unstructured (one global magnitude threshold found on the shards,
  `prune_select`), n:m, or hidden units (`prune_rows` shrinks column -> row pairs); the masks live
  beside the weights (`prune_masks`) and a gradual schedule applies them in training
  (`prune_schedule`);
* `sparse` (`bd.to_sparse`, `bd.SparseLinear`) and `quant` (`bd.quantize_int8`, `bd.Int8Linear`):
  inference stand-ins, a local product of another kind inside the dense layer's communication
  (`inference`).

``python -m bigdense.compress`` applies them to a checkpoint.
"""
from .lowrank import LowRankPair, low_rank, low_rank_like
from .prune_masks import apply_masks
from .pruning import PruneReport, attach_masks, prune
from .quant import Int8Linear, quantize_int8
from .sparse import SparseLinear, SparseReport, to_sparse

__all__ = ["low_rank", "low_rank_like", "LowRankPair", "prune", "PruneReport", "attach_masks", "apply_masks", "Int8Linear",
           "quantize_int8", "SparseLinear", "SparseReport", "to_sparse"]
