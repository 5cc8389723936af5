"""What the tests (and the benchmarks, and a user checking their own model) need to run and measure
bigdense on CPU: `run_ranks` (a simulated cluster of gloo processes, `ranks`), counters of aten ops,
host syncs and DeepSpeed's collective bytes (`counters`), `check_parallel` (is a converted model
exact? `check`), and the import-floor check (`floors`).
"""
from .check import ParallelCheck, check_parallel
from .counters import OpCounter, count_deepspeed_bytes
from .ranks import FAILURE_GRACE_S, RankError, run_ranks

__all__ = ["run_ranks", "RankError", "FAILURE_GRACE_S", "OpCounter", "count_deepspeed_bytes", "check_parallel",
           "ParallelCheck"]
