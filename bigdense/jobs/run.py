"""How both launchers start and end: `launch` is their ``if __name__ == "__main__"``, `run_job`
the body of their Hydra ``main``. A bad config is printed once per launch with exit code 2; a fault
the run cannot continue past (a second rollback at the same place, a failed save under
``trainer.on_save_error=stop``) exits with 1; a failed collective exits at once with 1, so that a
launcher with restarts resumes from ``latest`` (a background save still in flight would wait for
the missing peer, and is safely abandoned)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from ..config import check_override_keys
from ..errors import ConfigError
from ..train.faults import CollectiveFailure, TrainingStopped
from .setup import HeldStderr, stop

_held = HeldStderr()  # Hydra's own errors printed once under torchrun (by rank 0), like bigdense's


def launch(main: Callable[[], None]) -> None:
    """Check the command line's config keys before Hydra (whose answer to a misspelt key is a hint
    to add it with ``+``), then run the Hydra ``main`` with the other ranks' stderr held until the
    job starts. The deepspeed launcher's ``--local_rank=N`` is dropped: Hydra takes only key=value
    overrides, and LOCAL_RANK is in the environment anyway."""
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
    except TrainingStopped as err:
        print(f"bigdense: {err}", file=sys.stderr)
        sys.exit(1)
    except CollectiveFailure as err:
        print(f"bigdense: {err}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)
