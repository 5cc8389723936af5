"""Train the tiny TP model with the training job's fault handling, injecting the faults to handle.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 fault_train.py OUT --steps 12 --every 3 \
        [--nan-at 7,8] [--max-bad 2] [--hang-step 5 --hang-s 20 --timeout 4]

The loop is `launch/train.py`'s, with the same pieces: `RunCheckpoints` (asynchronous saves,
resume, rollback), `BadSteps`, `train_step_or_diagnose`. ``--nan-at``: data positions whose loss is
made NaN (on every rank, like a bad batch). ``--hang-step``: on torchrun's first attempt rank 1
sleeps ``--hang-s`` seconds inside that step, before its first collective. Rank 0 logs to
``OUT/events.jsonl``: each attempt's start, the data position of every step, rollbacks and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
import bigdense as bd  # noqa: E402
from bigdense.train.checkpointing import RunCheckpoints  # noqa: E402
from bigdense.train.faults import BadSteps, TrainingStopped, train_step_or_diagnose  # noqa: E402
from helpers import TinyLM, batch, make_optimizer  # noqa: E402


class TinyEngine:
    """The engine interface the loop needs: ``train_step`` (skipping non-finite steps on every rank)
    and ``checkpoint_state``."""

    def __init__(self, model, opt, sched, ctx, hang_step, hang_s):
        self.model, self.opt, self.sched, self.ctx = model, opt, sched, ctx
        self.hang_step, self.hang_s, self.step = hang_step, hang_s, 0

    def checkpoint_state(self):
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched}

    def train_step(self, micro_batches):
        self.step += 1
        (ids, target), poisoned = micro_batches[0]
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0 and self.step == self.hang_step and self.ctx.rank == 1:
            time.sleep(self.hang_s)  # a rank that stops responding inside the step
        loss = self.model(ids, target)
        if poisoned:
            loss = loss * float("nan")
        loss.backward()
        skipped = not bool(torch.isfinite(loss))  # the same on every rank: the loss is TP-reduced
        if not skipped:
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return SimpleNamespace(loss=loss.item(), skipped=skipped)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--nan-at", default="")
    p.add_argument("--max-bad", type=int, default=2)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--hang-s", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    nan_at = {int(x) for x in args.nan_at.split(",") if x}
    torch.set_num_threads(1)

    ctx = bd.init_parallel(tp=2, timeout=args.timeout)
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1)
    opt, sched = make_optimizer(model)
    engine = TinyEngine(model, opt, sched, ctx, args.hang_step, args.hang_s)
    tr = SimpleNamespace(keep_last=None, async_save=True, on_save_error="continue", checkpoint_verify="node")
    ckpts = RunCheckpoints(out, engine, tr)

    def event(**record):
        if ctx.rank == 0:
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    step, offset = ckpts.load_latest() or (0, 0)
    engine.step = step
    event(attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), start=step)
    bad = BadSteps(args.max_bad)
    try:
        while step < args.steps:
            step += 1
            pos = step + offset
            result = train_step_or_diagnose(engine, [(batch(pos), pos in nan_at)], ctx, step)
            event(step=step, pos=pos, skipped=result.skipped)
            if bad.record(step, pos, result.skipped):
                step, offset = ckpts.rollback(bad)
                engine.step = step
                event(rollback_to=step, offset=offset)
                continue
            if step % args.every == 0:
                ckpts.save(step, offset)
    except TrainingStopped as err:
        event(stopped=str(err))
        ckpts.settle()
        raise
    ckpts.settle()
    bd.save_checkpoint(out / "final", model, opt, scheduler=sched, step=args.steps, update_latest=False)
    bd.destroy_parallel()


if __name__ == "__main__":
    main()
