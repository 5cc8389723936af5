"""Compress a trained checkpoint's dense layers: low-rank factors, pruning, or int8 weights.

    python -m bigdense.compress CHECKPOINT --energy 0.9 [--layers PATTERN] [--out DIR]   # or --rank 32
    python -m bigdense.compress CHECKPOINT --prune 0.5 --structure rows                  # or unstructured, n:m
    python -m bigdense.compress CHECKPOINT --int8
    torchrun --nproc_per_node=2 -m bigdense.compress CHECKPOINT --rank 32    # sharded, any TP size

CHECKPOINT is one written by `launch/train.py` (its manifest holds the training config, hence the
model). Each dense layer whose module name matches a PATTERN (fnmatch; default ``blocks.*``) is
compressed by one method, each in its module:

* ``--energy`` / ``--rank`` (`lowrank`): replaced by its low-rank pair (`bd.low_rank`), unless the
  pair would not be smaller;
* ``--prune`` (`prune`): `bd.prune`'d, ``unstructured`` (one magnitude threshold over all the
  layers), ``n:m`` (2:4) or ``rows`` (hidden units of every block's MLP, the layers shrunk);
* ``--int8`` (`int8`): int8 weights with one scale per output feature (`bd.Int8Linear`).

Writes a checkpoint of the compressed model (``--out``, any TP size can load it) and
``compress_report.json`` there: per layer the parameters and FLOPs per token before/after, the
relative error of its weight (over the shards), the forward time before/after; and the held-out
loss before and after, evaluated as the run evaluated (its windows at the checkpoint's layout:
"before" is the loss the run logged at that step). The checkpoint's config records the structure it
needs (``model.low_rank``, ``model.d_hidden``, the ``compressed`` entry): `measure.load_reference_gpt`
builds it, and a fine-tune with ``trainer.init_from=DIR`` takes ``model.low_rank`` and
``model.d_hidden`` from it. The command that runs that fine-tune is printed last (`fine_tune`).
"""
from .cli import format_report, main, parse, run
from .lowrank import compress_model, relative_error
from .measure import DENSE, dense_layers, forward_ms, held_out_loss, load_reference_gpt

__all__ = ["main", "parse", "run", "format_report", "compress_model", "relative_error", "DENSE", "dense_layers",
           "forward_ms", "held_out_loss", "load_reference_gpt"]
