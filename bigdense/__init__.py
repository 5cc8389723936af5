"""bigdense: tensor-parallel dense layers for PyTorch, and the training machinery around them.

    import bigdense as bd
    ctx = bd.init_parallel(tp=2)
    fc1 = bd.ColumnParallelLinear(1024, 4096)
    fc2 = bd.RowParallelLinear(4096, 1024)
"""
from .layers import (
    INITIALIZERS,
    ColumnParallelLinear,
    Initializer,
    RowParallelLinear,
    TensorParallelModule,
    materialize,
)
from .parallel import (
    ParallelContext,
    ParallelDims,
    ShardSpec,
    destroy_parallel,
    get_default_context,
    init_parallel,
    set_default_context,
)

__version__ = "0.1.0"

__all__ = [
    "init_parallel", "destroy_parallel", "get_default_context", "set_default_context",
    "ParallelContext", "ParallelDims", "ShardSpec",
    "ColumnParallelLinear", "RowParallelLinear", "TensorParallelModule", "Initializer", "INITIALIZERS",
    "materialize",
]
