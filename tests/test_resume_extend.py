"""Resume, extend and start fresh: a run directory named with ``trainer.run_dir`` continues where
it stopped; a larger ``trainer.max_steps`` extends it with the learning-rate schedule of the new
length (the change is logged), instead of the schedule saved for the old length."""
import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from bigdense.config import OptimConfig
from bigdense.train.schedule import build_lr_schedule, follow_config
from helpers import ROOT, TRAIN


def lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


def test_an_extended_schedule_follows_the_new_max_steps():
    cfg = OmegaConf.structured(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5))
    first = build_lr_schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), cfg, 20)
    lrs(first, 20)
    assert first.get_last_lr()[0] == pytest.approx(1e-4)  # the floor: the 20-step schedule ended

    # The relaunch builds a 40-step schedule, then loading the checkpoint restores the 20-step settings.
    resumed = build_lr_schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), cfg, 40)
    resumed.load_state_dict(first.state_dict())
    assert resumed.lr_lambdas[0].total_steps == 20
    assert follow_config(resumed, cfg, 40) == ["trainer.max_steps: 20 -> 40"]
    straight = build_lr_schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), cfg, 40)
    expected = lrs(straight, 40)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected[19])  # the LR of step 21
    assert lrs(resumed, 20) == pytest.approx(expected[20:])
    assert follow_config(resumed, cfg, 40) == []  # an unchanged config changes nothing


def train(run_dir, small, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, TRAIN, *small, f"trainer.run_dir={run_dir}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out.stdout + out.stderr, {r["step"]: r["lr"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_resume_extend_and_start_fresh_through_launch(tmp_path, small):
    run = tmp_path / "run"
    _, first = train(run, small, "trainer.max_steps=4")
    assert (run / "checkpoints" / "latest").exists() and (run / "train_rank0.log").exists()

    out, _ = train(run, small, "trainer.max_steps=4")  # resume a finished run: nothing to do
    assert "nothing to train" in out and "at step 4 of 4" in out

    out, extended = train(run, small, "trainer.max_steps=8")  # extend: steps 5-8 on the 8-step schedule
    assert "at step 4 of 8" in out
    assert "the learning-rate schedule changed at resume (trainer.max_steps: 4 -> 8): from step 5" in out
    _, straight = train(tmp_path / "fresh", small, "trainer.max_steps=8")  # start fresh: another directory
    assert straight[2] == first[2]
    for step in (6, 8):
        assert extended[step] == pytest.approx(straight[step]), step
    assert extended[6] > 2 * OptimConfig.min_lr  # the saved 4-step schedule would sit at its floor, min_lr
