"""The step loop both training jobs share: which step comes next, its data position, when it logs,
evaluates and saves, host checks for the first steps, and the rollback past non-finite steps.

    loop = StepLoop(cfg.trainer, ckpts, start_step, data_offset, bar)
    for step in loop:
        result = train_step_or_diagnose(engine, batches_at(step.pos), ctx, step.number)
        if loop.record(step, result):      # rolled back: the loop goes on from the checkpoint's step
            continue
        if step.log:
            steps, step_time, summary = loop.interval()
        ...
        loop.end_of(step)

The batch of a step is a pure function of (seed, data position), and the data position is the step
plus an offset that only a rollback past bad batches moves. Nothing in a step reads the device on
the host: the steps' outcomes are read at the interval's sync points (log, evaluation, save), where
a run of bad steps triggers the rollback.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..host_checks import set_checks
from ..train.checkpointing import RunCheckpoints
from ..train.faults import BadSteps
from ..train.metrics import StepWindow


@dataclass(frozen=True)
class Step:
    number: int
    pos: int  # the data position: number + the rollback offset
    log: bool
    eval: bool
    save: bool


class StepLoop:
    """Steps ``start_step + 1 .. trainer.max_steps`` (see the module docstring)."""

    def __init__(self, tr, ckpts: RunCheckpoints, start_step: int, data_offset: int, bar):
        self.tr, self.ckpts, self.bar = tr, ckpts, bar
        self.start_step, self.step, self.data_offset = start_step, start_step, data_offset
        self.bad_steps = BadSteps(tr.max_bad_steps)
        self.window = StepWindow()
        self.explicit_checks = os.environ.get("BIGDENSE_CHECKS") is not None  # the user's word wins

    @property
    def trained(self) -> bool:
        """Whether this launch has steps to train (a resume at ``max_steps`` has none)."""
        return self.start_step < self.tr.max_steps

    def __iter__(self):
        tr = self.tr
        while self.step < tr.max_steps:
            self.step += 1
            n = self.step
            last = n == tr.max_steps
            if not self.explicit_checks:  # id/label range checks read the device: the first steps only
                set_checks(n <= self.start_step + tr.checked_steps)
            yield Step(n, n + self.data_offset, log=n % tr.log_interval == 0 or last,
                       eval=bool(tr.eval_interval) and n % tr.eval_interval == 0 and not last,
                       save=bool(tr.save_interval) and n % tr.save_interval == 0 and not last)

    def record(self, step: Step, result) -> bool:
        """Add the step's result; at a sync point show the pending outcomes to the bad-step count
        (one host read). True when that rolled the run back to its last checkpoint."""
        self.window.add(result, step.number, step.pos)
        self.bar.update(1)
        if (step.log or step.eval or step.save) and self.window.replay(self.bad_steps):
            self.step, self.data_offset = self.ckpts.rollback(self.bad_steps)
            self.bar.reset(total=self.tr.max_steps)
            self.bar.update(self.step)
            self.window = StepWindow()
            return True
        return False

    def interval(self) -> tuple[int, float, dict]:
        """(steps, mean step time in seconds, `StepWindow.read`'s summary) since the last log."""
        steps = self.window.steps
        return steps, (time.perf_counter() - self.window.start) / steps, self.window.read()

    def save(self, step: Step) -> None:
        self.ckpts.save(step.number, self.data_offset)

    def end_of(self, step: Step) -> None:
        if step.log:  # evaluation and saving stay out of the next interval's step time
            self.window = StepWindow()

    def finish(self) -> None:
        """The final checkpoint (unless the run had nothing to train), and waiting for it."""
        if self.trained:
            self.ckpts.save(self.tr.max_steps, self.data_offset)
        self.ckpts.settle()
