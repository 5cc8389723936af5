"""The faults a long run meets: non-finite steps (rollback, then stop), a hung rank (a message naming
the collective and the missing rank, then torchrun's restart resumes), a failed save (continue or
stop), and a checkpoint directory that cannot be written (stop before training)."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import bigdense as bd
from bigdense.checkpoint import save as save_module
from bigdense.config import ConfigError
from bigdense.testing import RankError, run_ranks
from bigdense.train.checkpointing import RunCheckpoints
from bigdense.train.faults import TrainingStopped, require_writable
from helpers import BIN, ROOT, TRAIN, TinyLM, make_optimizer

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import fault_train  # noqa: E402


def _events(out: Path):
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_non_finite_steps_roll_back_to_the_last_checkpoint_past_the_bad_batches(tmp_path):
    run_ranks(fault_train.main, 2, [str(tmp_path), "--steps", "12", "--every", "3", "--nan-at", "7,8",
                                    "--max-bad", "2"], timeout=120)
    events = _events(tmp_path)
    assert {"rollback_to": 6, "offset": 2} in events
    after = [e for e in events[events.index({"rollback_to": 6, "offset": 2}):] if "pos" in e]
    # Steps 7..12 again, on the batches after the bad ones (data positions 9..14), none skipped.
    assert [(e["step"], e["pos"], e["skipped"]) for e in after] == [(s, s + 2, False) for s in range(7, 13)]
    info = bd.load_checkpoint(tmp_path / "latest", TinyLM(), verify="all")
    assert info.step == 12 and info.extra == {"data_step": 14, "data_offset": 2}


def test_bad_steps_again_after_a_rollback_stop_the_run_naming_the_step_and_batch(tmp_path):
    with pytest.raises(RankError, match=r"again after rolling back to step 6; stopping at step 8, batch 10"):
        run_ranks(fault_train.main, 2, [str(tmp_path), "--steps", "12", "--every", "3", "--nan-at",
                                        ",".join(map(str, range(7, 20))), "--max-bad", "2"], timeout=120)
    assert "stopping at step 8, batch 10" in _events(tmp_path)[-1]["stopped"]


@pytest.mark.slow
def test_a_hung_rank_is_named_with_the_collective_and_torchrun_restart_resumes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.5", str(SCRIPTS / "fault_train.py"), str(tmp_path), "--steps", "8", "--every", "3",
           "--hang-step", "5", "--hang-s", "30", "--timeout", "5"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-20000:]
    # Rank 0 waited in the TP all-reduce of RowParallelLinear's forward while rank 1 slept.
    assert "rank 0: step 5: torch.distributed.all_reduce over ranks [0, 1]" in out, out[-20000:]
    assert "called from bigdense regions.forward" in out and "rank(s) [1] did not respond" in out, out[-20000:]
    starts = [e for e in _events(tmp_path) if "attempt" in e]
    assert starts == [{"attempt": 0, "start": 0}, {"attempt": 1, "start": 3}]
    assert bd.load_checkpoint(tmp_path / "final", TinyLM()).step == 8


def _full_disk(path, layout, produce, metadata=None):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_continues_or_stops_per_the_option(tmp_path, monkeypatch, async_save):
    model = TinyLM()
    opt, sched = make_optimizer(model)
    engine = SimpleNamespace(checkpoint_state=lambda: {"model": model, "optimizer": opt, "scheduler": sched})
    tr = SimpleNamespace(keep_last=None, async_save=async_save, on_save_error="continue", checkpoint_verify="node")
    ckpts = RunCheckpoints(tmp_path, engine, tr)
    ckpts.save(1)
    monkeypatch.setattr(save_module, "write_safetensors", _full_disk)
    ckpts.save(2)
    ckpts.settle()  # logged, not raised: training continues
    tr.on_save_error = "stop"
    with pytest.raises(TrainingStopped, match=r"on_save_error=stop.*step_0000003.*filesystem is full"):
        ckpts.save(3)  # a synchronous save fails here, an asynchronous one when it is waited for
        ckpts.settle()
    assert ckpts.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000001"]


def test_a_checkpoint_directory_that_cannot_be_written_stops_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"the checkpoint directory {blocker / 'checkpoints'} is not writable"):
        require_writable(blocker / "checkpoints", bd.get_default_context())


@pytest.mark.slow  # launches launch/train.py
def test_the_training_job_stops_before_training_on_an_unwritable_checkpoint_directory(tmp_path):
    # The run directory exists, its checkpoints/ cannot be made.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(BIN / "python"), TRAIN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"bigdense: bad config: the checkpoint directory {tmp_path / 'run' / 'checkpoints'}" in out.stderr


@pytest.mark.slow  # launches launch/train.py
@pytest.mark.parametrize("override,message", [
    ("trainer.keep_last=0", "trainer.keep_last must be > 0, got 0"),
    ("trainer.checkpoint_verify=sometimes", "trainer.checkpoint_verify='sometimes' is not one of ['node', 'first', "
                                            "'all', 'none']"),
    ("trainer.on_save_error=retry", "trainer.on_save_error='retry' is not one of ['continue', 'stop']"),
])
def test_bad_checkpoint_options_stop_before_training(tmp_path, override, message):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(BIN / "python"), TRAIN, override, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"bigdense: bad config: {message}" in out.stderr, out.stderr[-3000:]
