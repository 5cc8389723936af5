"""Convert an existing ``nn.Module`` (floor 3): `parallelize` turns its dense layers into tensor-parallel
ones in place, by a TP plan -- the one given, the model's own Hugging Face plan (`hf`), or the
automatic Linear pairs (`plans`); each plan style means what `styles` says; what no bigdense layer
replaces is converted in place (`inplace`); `tp_plan` says what it would convert."""
from .convert import ConversionReport, parallelize, plan_parallelism, tp_plan

__all__ = ["parallelize", "tp_plan", "plan_parallelism", "ConversionReport"]
