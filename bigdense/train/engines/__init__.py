"""Training engines: one interface for the loop (`base`), over torch DDP (`ddp`), DeepSpeed
(`deepspeed`, with every DeepSpeed-specific workaround in `ds_compat`) or FSDP2 (`fsdp`), chosen by
`factory`."""
from .base import Engine, EngineSettings, StepResult
from .ddp import DDPEngine
from .deepspeed import DSEngine
from .ds_compat import DeepSpeedMPU
from .fsdp import FSDPEngine
from .factory import ENGINES, build_engine

__all__ = ["Engine", "EngineSettings", "StepResult", "DDPEngine", "DSEngine", "DeepSpeedMPU", "FSDPEngine", "ENGINES",
           "build_engine"]
