"""bigdense: tensor-parallel dense layers for PyTorch, and the training machinery around them.

    import bigdense as bd
    ctx = bd.init_parallel(tp=2)
    fc1 = bd.ColumnParallelLinear(1024, 4096)
    fc2 = bd.RowParallelLinear(4096, 1024)

Each subpackage lists its public names in ``__all__``; this module re-exports all of them.
"""
from . import checkpoint, compression, layers, parallel, plan
from . import train
from .host_checks import checks_enabled, set_checks
from .checkpoint import *  # noqa: F401,F403
from .compression import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .parallel import *  # noqa: F401,F403
from .parallelize import parallelize, plan_parallelism, tp_plan
from .train import *  # noqa: F401,F403

__version__ = "0.1.0"

__all__ = [*parallel.__all__, *layers.__all__, *compression.__all__, *checkpoint.__all__, *train.__all__, "parallelize", "tp_plan", "plan_parallelism",
           "set_checks", "checks_enabled"]
