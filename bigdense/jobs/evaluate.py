"""The held-out loss of a language-model run: one definition for `launch/train.py`'s evaluations and
for `python -m bigdense.compress`'s loss before and after, so that the loss compress reports for a
checkpoint before compressing it is the one the run logged at that checkpoint's step.

A run's held-out set is ``trainer.eval_batches`` batches per DP rank: ``eval_batches x
micro_batch_size x dp`` windows spread evenly over the held-out split (`bigdense.data.batches`), so
it depends on the run's DP size. Evaluated at another DP size, the same windows are split over this
mesh's DP ranks instead (``run_dp``), which gives the run's number up to the order of the sums. With
records (`bigdense.data.records`) the held-out rows are the held-out records' rows in file order.
"""
from __future__ import annotations

from typing import Callable, Optional


def held_out_loss(eval_loss: Callable, data, ctx, n_batches: int, run_dp: Optional[int] = None) -> float:
    """Mean held-out loss over the counted targets of ``n_batches`` batches per DP rank of a run with
    ``run_dp`` DP ranks (default: this mesh's). ``eval_loss(x, y)``: a batch's ``(mean loss, counted
    targets)`` in eval mode over this mesh's DP group (`Engine.eval_loss_and_tokens`). Batches that
    count as many targets (windows of text) give the plain mean of batch means; masked records'
    batches are weighted by their targets, so the result is the mean over every counted target."""
    run_dp = ctx.dp_size if run_dp is None else int(run_dp)
    if (n_batches * run_dp) % ctx.dp_size:
        raise ValueError(f"held-out loss: {n_batches} batches x dp={run_dp} cannot be split over dp={ctx.dp_size}; "
                         f"evaluate at a DP size that divides {n_batches * run_dp}")
    results = [eval_loss(x, y) for x, y in data.val_batches(n_batches * run_dp // ctx.dp_size, ctx.dp_rank,
                                                            ctx.dp_size)]
    losses, tokens = zip(*results)
    if len(set(tokens)) == 1:
        return sum(losses) / len(losses)
    return sum(loss * n for loss, n in results) / sum(tokens)
