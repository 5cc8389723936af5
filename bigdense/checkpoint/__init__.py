"""Sharded checkpoints, resharding, dense export and import: what goes to and from disk.

    bd.save_checkpoint("runs/x/step_1000", model, optimizer, scheduler=sched, extra={"data_pos": pos})
    handle = bd.save_checkpoint("runs/x/step_2000", model, optimizer, async_=True)   # returns at once
    bd.wait_for_checkpoints()                               # or handle.wait(); both re-raise a failure
    info = bd.load_checkpoint("runs/x/latest", model, optimizer, scheduler=sched)   # at any tp / dp
    bd.export_dense("runs/x/latest", "model.safetensors")   # one unsharded file, plain nn.Module names
    bd.export_hf("runs/x", "exported")     # a CausalLM back to a Hugging Face directory (from_pretrained)
    bd.save_peft_adapter(model, "adapter")  # LoRA adapters as PEFT writes them; bd.load_peft_adapter reads them

See `bigdense.checkpoint.format` for the on-disk layout.
"""
from .background import SaveHandle, wait_for_checkpoints
from .dense import export_dense, load_dense_state_dict
from .format import CheckpointError, CheckpointMismatch
from .hf_export import export_hf
from .load import CheckpointInfo, load_checkpoint
from .peft import load_peft_adapter, save_peft_adapter
from .save import save_checkpoint

__all__ = [
    "save_checkpoint", "load_checkpoint", "SaveHandle", "wait_for_checkpoints", "CheckpointInfo", "CheckpointError",
    "CheckpointMismatch", "export_dense", "export_hf", "load_dense_state_dict",
    "save_peft_adapter", "load_peft_adapter",
]

_MOVED = {"parallelize": "bigdense.parallelize", "plan_parallelism": "bigdense.parallelize", "tp_plan": "bigdense.parallelize",
          "ShardedDropout": "bigdense.layers"}


def __getattr__(name):
    """``from bigdense.checkpoint import parallelize`` keeps working: model conversion lives in
    `bigdense.parallelize` and `ShardedDropout` in `bigdense.layers`."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
