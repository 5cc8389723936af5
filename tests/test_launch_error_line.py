"""The line that ends a launch leads the output: under torchrun, rank 0 prints its ``bigdense:``
line as it exits, before torchrun's own report (its stack trace, then the workers it stopped),
which ends with the line again (torchrun's error file); the other rank says nothing. And a run
whose latest checkpoint cannot be read says what to do next: start over, ``trainer.resume=false``,
or an earlier checkpoint named in ``latest``.
"""
import os
import subprocess
from types import SimpleNamespace

import pytest

from bigdense.checkpoint import CheckpointError
from bigdense.train.checkpointing import RunCheckpoints
from helpers import BIN, TRAIN, TinyLM, make_optimizer


@pytest.mark.slow  # a torchrun launch (two processes importing torch): 12-30 s on 2 cores
def test_under_torchrun_the_bigdense_line_is_among_the_first(tmp_path):
    # The config is refused in the Hydra callback, before any data or model: the launch is imports.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN, "parallel.tp=3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    message = ("bigdense: bad config: parallel.tp=3 does not divide the number of processes (2); with 2 processes, "
               "tp must be one of [1, 2]")
    lines = [line for line in out.splitlines() if line.strip()]
    assert done.returncode != 0 and message in lines[:2], out
    assert out.count(message) == 2 and lines[-2].endswith(message), out  # and last, in torchrun's summary
    assert "bigdense (rank 1)" not in out and list(tmp_path.iterdir()) == [], out


def test_a_latest_checkpoint_that_cannot_be_read_says_what_to_do_next(tmp_path):
    model = TinyLM()
    opt, sched = make_optimizer(model)
    engine = SimpleNamespace(checkpoint_state=lambda: {"model": model, "optimizer": opt, "scheduler": sched})
    tr = SimpleNamespace(keep_last=None, async_save=False, on_save_error="stop", checkpoint_verify="all")
    ckpts = RunCheckpoints(tmp_path / "run" / "checkpoints", engine, tr)
    ckpts.save(2)
    ckpts.save(4)
    shard = next((tmp_path / "run" / "checkpoints" / "step_0000004").rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of a tensor: the checksum no longer matches
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        ckpts.load_latest()
    message = str(err.value)
    assert message.startswith(f"cannot resume {tmp_path / 'run'}: ") and "fails its checksum" in message, message
    latest = tmp_path / "run" / "checkpoints" / "latest"
    assert message.endswith(
        ". To go on, start in a new trainer.run_dir, or pass trainer.resume=false to train from step 0 there, "
        f"ignoring its checkpoints; or resume from an earlier checkpoint by writing its name (step_0000002) into "
        f"{latest}"), message
    # Which is what it says: with step_0000002 named, the run resumes at step 2.
    latest.write_text("step_0000002\n")
    assert ckpts.load_latest()[0] == 2
