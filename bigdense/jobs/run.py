"""How both launchers start and end: `launch` is their ``if __name__ == "__main__"``, `run_job`
the body of their Hydra ``main``, and `CheckConfigFirst` the Hydra callback (``hydra.callbacks`` in
``conf/config.yaml`` and ``conf/classify.yaml``) that checks the config before Hydra makes the run
directory, so a launch stopped by its config leaves no directory behind (the job checks it again,
for callers that come without Hydra).

Every message that ends a launch is printed once, by rank 0 as it exits (under torchrun, before
torchrun's own report of the failure), and, under torchrun, handed to torchrun's error file, so it
is also the last thing torchrun prints (`bigdense.jobs.setup.stop`); once the run directory exists
it is also written to this rank's log file there, which would otherwise not say why the launch
ended. A bad config and a checkpoint that cannot be loaded exit with code 2; a fault
the run cannot continue past (a second rollback at the same place, a failed save under
``trainer.on_save_error=stop``) with 1; a failed collective exits at once with 1, on every rank with
its own view of it, so that a launcher with restarts resumes from ``latest`` (a background save
still in flight would wait for the missing peer, and is safely abandoned)."""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from typing import Callable

from hydra.experimental.callback import Callback
from omegaconf import open_dict, read_write

from ..checkpoint import CheckpointError
from ..config import check_override_keys
from ..data.prepare import check_source
from ..errors import ConfigError
from ..train.faults import CollectiveFailure, TrainingStopped
from .models import model_tokenizer
from .setup import HeldStderr, check_config, stop, tell_launcher

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
    with exits():
        job(cfg)


class CheckConfigFirst(Callback):
    """Hydra's ``on_run_start``, which comes after the config is composed and before the run
    directory is made: the job's config is checked there (`check_config`, on every rank), and its
    corpus listed (`check_source`: no file, too few bytes for two windows, a bad record), so a bad value stops
    the launch before anything is written. A sweep's jobs are checked each in its own directory, by
    the job."""

    def on_run_start(self, config, **kwargs) -> None:
        job_config = copy.deepcopy(config)  # what the job gets: the config without Hydra's own node
        with read_write(job_config), open_dict(job_config):
            del job_config["hydra"]
        # Hydra turns a callback's exception into a warning and goes on; `exits` stops the launch.
        with exits():
            check_config(job_config)
            # The files listed by size (too few stop the launch here too); records read and checked.
            check_source(job_config.data, model_tokenizer(job_config))


@contextlib.contextmanager
def exits():
    """bigdense's errors, raised inside, turned into the exits described above."""
    try:
        yield
    except ConfigError as err:  # raised before any training step, normally on every rank alike
        _stop(f"bigdense: bad config: {err}", 2)
    except CheckpointError as err:  # every rank agrees on a load's failure (`bigdense.checkpoint`)
        _stop(f"bigdense: checkpoint: {err}", 2)
    except TrainingStopped as err:
        _stop(f"bigdense: {err}", 1)
    except CollectiveFailure as err:
        message = f"bigdense: {err}"
        _write_to_log_files(message)
        tell_launcher(message)
        print(message, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)


def _stop(message: str, code: int):
    """`stop` with what Hydra wrote to stderr until now printed first, the message written to
    this rank's log file when there is one."""
    _held.release()
    _write_to_log_files(message)
    stop(message, code)


def _write_to_log_files(message: str) -> None:
    """``message`` as an error in this rank's log file (``train_rank<N>.log``), not on the console,
    which `stop` prints it on once. Before Hydra configured the job's logging there is no file."""
    record = logging.LogRecord("bigdense", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
