"""Crash recovery under torchrun: a rank SIGKILLed mid-training, the job restarts, resumes, and ends
exactly where an uninterrupted run ends (model and optimizer, bit for bit)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bigdense as bd
from bigdense.testing import run_ranks

from helpers import TinyLM, local_states, make_optimizer

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import crash_train  # noqa: E402

pytestmark = pytest.mark.slow  # a torchrun job killed and restarted


def _final_state(ckpt):
    torch.manual_seed(123)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    info = bd.load_checkpoint(ckpt, model, opt, scheduler=sched)
    return info.step, local_states(model, opt), sched.state_dict()


def test_torchrun_restart_after_sigkill_resumes_from_last_checkpoint_and_matches_uninterrupted_run(tmp_path):
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    crashed.mkdir(), clean.mkdir()
    # torchrun shares its rendezvous TCPStore with the workers' process group by default, so on a
    # restart gloo can read the dead attempt's peer addresses from it and fail to connect
    # (pytorch/pytorch#135712, still seen with torch 2.13); a fresh store per attempt avoids that.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.5", str(SCRIPTS / "crash_train.py"), str(crashed), "--steps", "12", "--every", "3",
           "--kill-at", "7"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-20000:]

    attempts = [json.loads(line) for line in (crashed / "attempts.jsonl").read_text().splitlines()]
    # Killed at step 7 on the first attempt; restarted from the checkpoint written after step 6.
    assert attempts == [{"attempt": 0, "start": 0}, {"attempt": 1, "start": 6}]

    run_ranks(crash_train.main, 2, [str(clean), "--steps", "12", "--every", "3"], timeout=120)
    clean_attempts = [json.loads(line) for line in (clean / "attempts.jsonl").read_text().splitlines()]
    assert clean_attempts == [{"attempt": 0, "start": 0}]

    step_a, state_a, sched_a = _final_state(crashed / "final")
    step_b, state_b, sched_b = _final_state(clean / "final")
    assert step_a == step_b == 12 and sched_a == sched_b
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
