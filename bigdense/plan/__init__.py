"""The memory planner: what layout fits a model on given devices (``python -m bigdense.plan``)."""
from .count import ParamEntry, count_per_rank, param_entries
from .estimate import Estimate, estimate
from .layout import Layout
from .muon import MuonPlan, MuonSettings

__all__ = ["estimate", "Estimate", "Layout", "ParamEntry", "param_entries", "count_per_rank", "MuonSettings",
           "MuonPlan"]
