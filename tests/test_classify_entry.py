"""`launch/classify.py` end to end: the file-classification task on a small corpus, TP-sharded in one
process and world-sharded with sampling and a margin under torchrun (tp=1 x dp=2), held-out top-1 /
top-5 in metrics.jsonl, the plot and the checkpoint; the run machinery it shares with launch/train.py
(asynchronous saves, keep_last, resume, rollback after non-finite steps); a bad head option stops it
naming the key."""
import json
import os
import subprocess
import sys

import pytest

from helpers import BIN, ROOT

pytestmark = pytest.mark.slow  # each case launches launch/classify.py in fresh processes

CLASSIFY = str(ROOT / "launch" / "classify.py")


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def _small(small):
    # The shared small corpus, 16-token windows (so its short files still make classes), a tiny encoder.
    return [o for o in small if not o.startswith("data.seq_len")] + [
        "data.seq_len=16", "model.max_seq_len=16", "trainer.max_steps=4", "trainer.eval_interval=2",
        "trainer.log_interval=2", "data.micro_batch_size=4",
    ]


@pytest.mark.parametrize("launcher", ["python", "torchrun-world"])
def test_classify_trains_and_reports_top_k(tmp_path, small, launcher):
    run_dir = tmp_path / "run"
    args = [*_small(small), f"hydra.run.dir={run_dir}"]
    if launcher == "python":
        cmd = [sys.executable, CLASSIFY, *args]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", CLASSIFY, *args, "parallel.tp=1",
               "head=partial_fc", "head.sample_rate=0.5"]
    code, out = run(cmd)
    assert code == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0.0 <= r["top1"] <= r["top5"] <= 1.0 and r["eval_loss"] > 0 for r in evals)
    assert (run_dir / "loss_curve.png").exists() and (run_dir / "checkpoints" / "latest").exists()
    if launcher != "python":
        assert "shard='world'" in out


def test_bad_head_option_names_the_key(tmp_path, small):
    code, out = run([sys.executable, CLASSIFY, *_small(small), "head.sample_rate=0", f"hydra.run.dir={tmp_path}"])
    assert code == 2 and "bad config: head.sample_rate=0" in out and "must be in (0, 1]" in out, out


def test_classify_saves_in_the_background_resumes_and_extends(tmp_path, small):
    # The same run machinery as launch/train.py: asynchronous saves (the default), keep_last, resume.
    run_dir = tmp_path / "run"
    args = [*_small(small), f"trainer.run_dir={run_dir}", "trainer.save_interval=2", "trainer.keep_last=1"]
    code, out = run([sys.executable, CLASSIFY, *args])
    assert code == 0, out
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_0000004"], kept  # keep_last=1 removed step 2 once step 4 was complete
    code, out = run([sys.executable, CLASSIFY, *args, "trainer.max_steps=6"])
    assert code == 0 and "resumed from" in out and "at step 4 of 6" in out, out
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [2, 4, 6]  # run 2 picks up after step 4


def test_classify_rolls_back_after_non_finite_steps_then_stops(tmp_path, small):
    # An absurd learning rate makes every step after the first non-finite: the job rolls back to its
    # last checkpoint (trainer.max_bad_steps=1), meets them again, and stops naming the step (exit 1).
    args = [*_small(small), f"hydra.run.dir={tmp_path}", "optim.lr=1e30", "optim.warmup_steps=0",
            "trainer.max_bad_steps=1", "trainer.save_interval=1", "trainer.log_interval=1", "trainer.max_steps=6"]
    code, out = run([sys.executable, CLASSIFY, *args])
    assert code == 1, out
    assert "rolling back to the checkpoint of step" in out and "again after rolling back to step" in out, out
