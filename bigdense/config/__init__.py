"""The training configuration: schemas, the checks of what a schema cannot say, and Hydra's registration.

* `schema`: one dataclass per Hydra config group (``conf/<group>/``), with documented defaults --
  every key of the jobs is defined there.
* `keys`: a key no schema defines (misspelt on the command line, appended with ``+`` or written in
  an option file) stops the run naming the closest valid key.
* `validate`: ranges, combinations and the machine, asked of the code that owns each rule, before
  any work; raises `ConfigError` naming the key.
* `registry`: `register_configs` (the schemas in Hydra's ConfigStore, the run directory's resolver).
"""
from ..errors import ConfigError
from .keys import check_known_keys, check_override_keys, schema_keys, unknown_key_error
from .registry import register_configs, run_dir_name
from .schema import (
    DataConfig, EngineConfig, HeadConfig, LoRAConfig, ModelConfig, OptimConfig, ParallelConfig, PlanConfig, PrecisionConfig,
    PruneConfig, RecomputeConfig, TrainConfig, TrainerConfig,
)
from .validate import validate, validate_plan

__all__ = [
    "ConfigError", "check_known_keys", "check_override_keys", "schema_keys", "unknown_key_error", "register_configs",
    "run_dir_name", "DataConfig", "EngineConfig", "HeadConfig", "LoRAConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PlanConfig", "PrecisionConfig", "PruneConfig", "RecomputeConfig", "TrainConfig", "TrainerConfig", "validate", "validate_plan",
]
