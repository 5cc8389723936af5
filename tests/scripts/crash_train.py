"""Train the tiny TP model at tp=2, checkpointing every few steps, resuming from ``latest`` if there is one.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 crash_train.py OUT --steps 12 --every 3 --kill-at 7

On torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT == 0``) rank 1 SIGKILLs itself at step
``--kill-at``; torchrun then restarts every worker and the job resumes from the last complete
checkpoint. The final state is saved to ``OUT/final``; rank 0 logs each attempt's starting step
to ``OUT/attempts.jsonl``. ``--kill-at -1`` gives the uninterrupted run.

Run it with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: otherwise the restarted workers share
torchrun's rendezvous store with the dead ones and gloo may pick up stale peer addresses from it
(pytorch/pytorch#135712).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
import bigdense as bd  # noqa: E402
from helpers import TinyLM, batch, make_optimizer  # noqa: E402

# Survivors of a dead peer give up after this long instead of waiting forever in a collective
# (torchrun normally stops them much sooner, when it sees the peer die).
COLLECTIVE_TIMEOUT_S = 30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args(argv)
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)

    ctx = bd.init_parallel(tp=2, timeout=COLLECTIVE_TIMEOUT_S)
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1)
    opt, sched = make_optimizer(model)
    start = 0
    if (out / "latest").exists():
        start = bd.load_checkpoint(out / "latest", model, opt, scheduler=sched).extra["next_step"]
    if ctx.rank == 0:
        with open(out / "attempts.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "start": start}) + "\n")

    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_at and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.every == 0:
            bd.save_checkpoint(out / f"step_{step + 1}", model, opt, scheduler=sched,
                               extra={"next_step": step + 1}, step=step + 1)
    bd.save_checkpoint(out / "final", model, opt, scheduler=sched, extra={"next_step": args.steps},
                       step=args.steps, update_latest=False)
    bd.destroy_parallel()


if __name__ == "__main__":
    main()
