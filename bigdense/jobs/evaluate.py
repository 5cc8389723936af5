"""The held-out loss of a language-model run: one definition for `launch/train.py`'s evaluations and
for `python -m bigdense.compress`'s loss before and after, so that the loss compress reports for a
checkpoint before compressing it is the one the run logged at that checkpoint's step.

A run's held-out set is ``trainer.eval_batches`` batches per DP rank: ``eval_batches x
micro_batch_size x dp`` windows spread evenly over the held-out split (`bigdense.data.batches`), so
it depends on the run's DP size. Evaluated at another DP size, the same windows are split over this
mesh's DP ranks instead (``run_dp``), which gives the run's number up to the order of the sums.
"""
from __future__ import annotations

from typing import Callable, Optional


def held_out_loss(eval_loss: Callable, data, ctx, n_batches: int, run_dp: Optional[int] = None) -> float:
    """Mean held-out loss over the windows of ``n_batches`` batches per DP rank of a run with
    ``run_dp`` DP ranks (default: this mesh's). ``eval_loss(x, y)``: a batch's mean loss in eval
    mode, averaged over this mesh's DP group (`Engine.eval_loss`). Every batch holds as many tokens,
    so the mean of batch means is the mean over all the windows' tokens, whatever the split."""
    run_dp = ctx.dp_size if run_dp is None else int(run_dp)
    if (n_batches * run_dp) % ctx.dp_size:
        raise ValueError(f"held-out loss: {n_batches} batches x dp={run_dp} cannot be split over dp={ctx.dp_size}; "
                         f"evaluate at a DP size that divides {n_batches * run_dp}")
    losses = [eval_loss(x, y) for x, y in data.val_batches(n_batches * run_dp // ctx.dp_size, ctx.dp_rank,
                                                           ctx.dp_size)]
    return sum(losses) / len(losses)
