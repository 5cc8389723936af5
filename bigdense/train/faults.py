"""Faults a long run meets, each turned into a decision or a message that names what went wrong.

- `BadSteps`: consecutive steps skipped for non-finite loss or gradients (every rank agrees on a
  skip, so every rank counts alike); past ``trainer.max_bad_steps`` the run rolls back to the
  last checkpoint and moves its data position past the bad batches; needing a second rollback to
  the same checkpoint stops the run, naming the step and the batch.
- `CollectiveFailure` / `diagnose_collective_failure`: a collective that failed (a peer that stopped
  responding lets it run into ``parallel.timeout_s``; a peer that died closes the connection). The
  message names the collective (from the traceback: the torch.distributed call, the bigdense
  function that made it, the group's ranks) and the ranks that did not respond: every surviving
  rank reports to the process group's store, and those that do not report within a few seconds are
  named. The process then exits non-zero, so torchrun's restart resumes the job from `latest`.
  `train_step_or_diagnose` is the training step with that diagnosis around it.
- `require_writable`: the checkpoint directory is probed before training starts.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..parallel import comm
from ..errors import ConfigError

log = logging.getLogger("bigdense")


class TrainingStopped(RuntimeError):
    """The run cannot go on; the message says where and why."""


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out; the message names it and the ranks that did not respond."""


@dataclass
class BadSteps:
    """Counts consecutive non-finite steps and decides when to roll back (see the module docstring)."""

    max_bad_steps: int
    run: list[tuple[int, int]] = field(default_factory=list)  # (step, data position) of the current bad run
    rollbacks: dict[int, int] = field(default_factory=dict)  # checkpoint step -> rollbacks to it

    def record(self, step: int, data_pos: int, bad: bool) -> bool:
        """Note a step's outcome; True when the run must roll back now."""
        if not bad:
            self.run.clear()
            return False
        self.run.append((step, data_pos))
        return self.max_bad_steps > 0 and len(self.run) >= self.max_bad_steps

    def rollback_offset(self, checkpoint_step: Optional[int]) -> int:
        """The data offset to continue from ``checkpoint_step`` with: the first step after it takes
        the batch after the last bad one. Raises `TrainingStopped` when there is no checkpoint or
        this checkpoint was rolled back to already."""
        first, last = self.run[0], self.run[-1]
        where = (f"{len(self.run)} consecutive steps with non-finite loss or gradients, steps {first[0]}..{last[0]} "
                 f"(batches at data positions {first[1]}..{last[1]})")
        if checkpoint_step is None:
            raise TrainingStopped(f"{where}, and no checkpoint to roll back to; stopping at step {last[0]}, "
                                  f"batch {last[1]}")
        if self.rollbacks.get(checkpoint_step):
            raise TrainingStopped(f"{where} again after rolling back to step {checkpoint_step}; stopping at step "
                                  f"{last[0]}, batch {last[1]} (lower the learning rate, check the data there)")
        self.rollbacks[checkpoint_step] = 1
        log.warning("%s: rolling back to the checkpoint of step %d and skipping those batches", where, checkpoint_step)
        self.run.clear()
        return last[1] + 1 - (checkpoint_step + 1)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a torch.distributed call, or a backend's error)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return "distributed_c10d" in describe_collective(exc) or any(
        word in text for word in ("gloo", "NCCL", "Connection closed by peer", "Timed out waiting"))


def require_writable(path: Path, ctx) -> None:
    """Every rank raises `ConfigError` naming ``path`` unless rank 0 can create files in it."""
    problem = None
    if ctx.rank == 0:
        probe = Path(path) / f".write-probe-{os.getpid()}"
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            problem = f"the checkpoint directory {path} is not writable ({exc.strerror or exc})"
    if ctx.is_distributed:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem + "; set hydra.run.dir to a writable place")


# ---- a collective that failed --------------------------------------------------------------------


def describe_collective(exc: BaseException) -> str:
    """The collective ``exc`` was raised in, from its traceback (innermost torch.distributed call)."""
    c10d, ranks, frames = None, None, []
    tb = exc.__traceback__
    while tb is not None:
        code, local = tb.tb_frame.f_code, tb.tb_frame.f_locals
        pending = local.get("self") if code.co_name == "wait" else None
        if isinstance(pending, comm.Pending) and c10d is None:
            # bigdense's asynchronous collectives fail in the backend's wait(), below any Python frame
            # of torch.distributed: the Pending names the collective and its group.
            c10d, ranks = pending.kind, _group_ranks(pending.group)
        elif code.co_filename.endswith("distributed_c10d.py") and not code.co_name.startswith("_"):
            c10d, ranks = code.co_name, _group_ranks(local.get("group"))
        elif f"{os.sep}bigdense{os.sep}" in code.co_filename and c10d is None:
            frames.append(f"{Path(code.co_filename).stem}.{code.co_name}")
        tb = tb.tb_next
    # The raw collective wrappers (comm.py) say little; the function that called them says where.
    callers = [f for f in frames if not f.startswith("comm.")]
    caller = " via ".join(([callers[-1]] if callers else []) + [f for f in frames[-1:] if f.startswith("comm.")])
    if c10d is None:
        return "a collective run outside Python (DDP's gradient all-reduce or an autograd backward's)"
    over = f" over ranks {ranks}" if ranks is not None else " over the world"
    return f"torch.distributed.{c10d}{over}" + (f" (called from bigdense {caller})" if caller else "")


def _group_ranks(group) -> Optional[list[int]]:
    try:
        return dist.get_process_group_ranks(group) if group is not None else None
    except Exception:  # noqa: BLE001 - a destroyed group: name the call without its ranks
        return None


def diagnose_collective_failure(exc: BaseException, ctx, step: int, wait_s: float = 5.0) -> CollectiveFailure:
    """A `CollectiveFailure` for ``exc``: the collective, and the ranks that do not report in ``wait_s``."""
    missing = _ranks_not_responding(ctx, step, wait_s)
    who = (f"rank(s) {missing} did not respond" if missing else "every rank responded afterwards (a slow rank?)"
           ) if missing is not None else "the ranks that did not respond are unknown (the store is gone)"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveFailure(
        f"rank {ctx.rank}: step {step}: {describe_collective(exc)} failed: {first_line[:200]}; {who}. "
        f"Exiting so the launcher can restart the job from the last checkpoint."
    )


def _ranks_not_responding(ctx, step: int, wait_s: float) -> Optional[list[int]]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"bigdense/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{step}/"
        store.set(prefix + str(ctx.rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(ctx.world_size) if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store lived in a rank that is gone
        return None


def train_step_or_diagnose(engine, micro_batches, ctx, step: int):
    """``engine.train_step``; a failed collective becomes a `CollectiveFailure` naming it and the
    ranks that stopped responding (other errors pass unchanged)."""
    try:
        return engine.train_step(micro_batches)
    except RuntimeError as exc:
        if is_collective_failure(exc):
            raise diagnose_collective_failure(exc, ctx, step) from exc
        raise
