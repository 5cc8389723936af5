"""Training engines: one interface for the loop (`base`), over torch DDP (`ddp`) or DeepSpeed
(`deepspeed`, with every DeepSpeed-specific workaround in `ds_compat`), chosen by `factory`."""
from .base import Engine, EngineSettings, StepResult
from .ddp import DDPEngine
from .deepspeed import DSEngine
from .ds_compat import DeepSpeedMPU
from .factory import ENGINES, build_engine

__all__ = ["Engine", "EngineSettings", "StepResult", "DDPEngine", "DSEngine", "DeepSpeedMPU", "ENGINES",
           "build_engine"]
