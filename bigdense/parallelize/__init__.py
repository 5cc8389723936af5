"""Convert an existing ``nn.Module`` (floor 3): `parallelize` turns its dense layers into bigdense
layers in place, by a TP plan -- the one given, the model's own Hugging Face plan (`hf`), or the
automatic Linear pairs (`convert`); `tp_plan` says what it would convert."""
from .convert import parallelize, plan_parallelism, tp_plan

__all__ = ["parallelize", "tp_plan", "plan_parallelism"]
