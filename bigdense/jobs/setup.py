"""Starting a run, for both launchers: the config checked on every rank, the mesh built from the
`ParallelDims` that check resolved (once per launch), every generator seeded, the run directory
agreed on; and a bad config reported once per launch (`stop`, `HeldStderr`)."""
from __future__ import annotations

import io
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..config import validate
from ..parallel.context import ParallelContext, init_parallel
from ..train.faults import require_writable

log = logging.getLogger("bigdense")


@dataclass
class Run:
    ctx: ParallelContext
    run_dir: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def launcher_world() -> tuple[int, int]:
    """(rank, world size) as the launcher set them, before any process group exists."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def stop(message: str, code: int):
    """Print a message that every rank meets alike (a bad config) once, then exit with ``code``.

    Rank 0 prints at once. The other ranks leave it to rank 0: torchrun stops every rank once one
    exits, so they are normally stopped while they wait, silently. One still here after that,
    rank 0 did not meet the error (a check that depends on the machine): it says it.
    """
    rank = launcher_world()[0]
    if rank != 0:
        time.sleep(10)
        message = message.replace("bigdense: bad config: ", f"bigdense: bad config (rank {rank}): ", 1)
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


class HeldStderr:
    """On ranks other than 0, holds what Hydra writes to stderr until the job starts, so its
    composition errors go through `stop` (printed once) rather than once per rank."""

    def __init__(self):
        self.real = sys.stderr
        self.held = io.StringIO() if launcher_world()[0] != 0 else None

    def __enter__(self):
        if self.held is not None:
            sys.stderr = self.held
        return self

    def release(self) -> None:
        """The job started: what was held (warnings) is written out, stderr is stderr again."""
        if sys.stderr is self.held:
            sys.stderr = self.real
            self.real.write(self.held.getvalue())

    def __exit__(self, kind, err, tb) -> None:
        if kind is SystemExit and err.code and sys.stderr is self.held and self.held.getvalue():
            sys.stderr = self.real
            stop(self.held.getvalue().rstrip(), err.code)
        self.release()


def start_run(cfg, hydra_output_dir: str) -> Run:
    """Check the config, build the mesh, seed every generator, agree on the run directory and make
    sure its checkpoints/ can be written.

    The config is validated on every rank before the process group exists, so a bad value stops
    all ranks at once with the same message (raised as `ConfigError`).
    """
    _, world = launcher_world()
    use_cuda = torch.cuda.is_available() and cfg.parallel.backend in (None, "nccl")
    dims = validate(cfg, world, "cuda" if use_cuda else "cpu")
    ctx = init_parallel(dims=dims, backend=cfg.parallel.backend, timeout=cfg.parallel.timeout_s)
    # Every rank gets the same seed: TP-invariant initialisation and dropout rely on the ranks of a
    # TP group drawing the same numbers; data order comes from its own generator.
    seed_everything(cfg.trainer.seed)
    run_dir = [hydra_output_dir]
    if ctx.is_distributed:
        # Ranks may have started in different seconds; rank 0's directory is the run's.
        dist.broadcast_object_list(run_dir, src=0)
    run = Run(ctx, Path(run_dir[0]))
    require_writable(run.checkpoint_dir, ctx)  # made by rank 0; a ConfigError on every rank if it cannot be
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    return run


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
