"""How both launchers start and end: `launch` is their ``if __name__ == "__main__"``, `run_job`
the body of their Hydra ``main``.

Every message that ends a launch is printed once and, under torchrun, handed to torchrun's error
file, so it is also the last thing torchrun prints (`bigdense.jobs.setup.stop`). A bad config and a
checkpoint that cannot be loaded exit with code 2; a fault the run cannot continue past (a second
rollback at the same place, a failed save under ``trainer.on_save_error=stop``) with 1; a failed
collective exits at once with 1, on every rank with its own view of it, so that a launcher with
restarts resumes from ``latest`` (a background save still in flight would wait for the missing
peer, and is safely abandoned)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from ..checkpoint import CheckpointError
from ..config import check_override_keys
from ..errors import ConfigError
from ..train.faults import CollectiveFailure, TrainingStopped
from .setup import HeldStderr, stop, tell_launcher

_held = HeldStderr()  # Hydra's own errors printed once under torchrun, like bigdense's


def launch(main: Callable[[], None]) -> None:
    """Check the command line's config keys before Hydra (whose answer to a misspelt key is a hint
    to add it with ``+``), then run the Hydra ``main`` with stderr held until the job starts. The
    deepspeed launcher's ``--local_rank=N`` is dropped: Hydra takes only key=value overrides, and
    LOCAL_RANK is in the environment anyway."""
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        stop(f"bigdense: bad config: {err}", 2)
    with _held:
        main()


def run_job(job: Callable, cfg) -> None:
    """``job(cfg)``, with bigdense's errors turned into the exits described above."""
    _held.release()
    try:
        job(cfg)
    except ConfigError as err:  # raised before any training step, normally on every rank alike
        stop(f"bigdense: bad config: {err}", 2)
    except CheckpointError as err:  # every rank agrees on a load's failure (`bigdense.checkpoint`)
        stop(f"bigdense: checkpoint: {err}", 2)
    except TrainingStopped as err:
        stop(f"bigdense: {err}", 1)
    except CollectiveFailure as err:
        message = f"bigdense: {err}"
        tell_launcher(message)
        print(message, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)
