"""Training machinery: gradient clipping, mixed precision, activation checkpointing, engines."""
from .clip import clip_grad_norm_, grad_norm
from .engines import DDPEngine, DeepSpeedMPU, DSEngine, Engine, EngineSettings, StepResult, build_engine
from .precision import DynamicLossScaler, Precision, autocast, compute_dtype
from .recompute import apply_recompute, checkpoint_module, is_checkpointed, uncheckpoint_module
from .schedule import WarmupCosine, build_lr_schedule

__all__ = [
    "clip_grad_norm_", "grad_norm", "DynamicLossScaler", "Precision", "autocast", "compute_dtype", "apply_recompute",
    "checkpoint_module", "uncheckpoint_module", "is_checkpointed", "build_engine", "Engine", "DDPEngine",
    "DSEngine", "EngineSettings", "StepResult", "DeepSpeedMPU", "build_lr_schedule", "WarmupCosine",
]
