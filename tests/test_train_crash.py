"""Crash recovery through the real entry point: `torchrun --max-restarts=1 launch/train.py`,
one rank SIGKILLed in the middle of training, the job restarts, resumes from the last complete
checkpoint of its run directory, and ends with exactly the weights of a run never interrupted."""
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import bigdense as bd

from helpers import BIN, ROOT, TRAIN

pytestmark = pytest.mark.slow  # a torchrun job killed and restarted

STEPS, SAVE_EVERY, KILL_AFTER = 30, 5, 10


# The DDP engine at tp=2; the FSDP engine at tp=2 x dp=2 (parameters and AdamW state sharded over DP too).
LAYOUTS = {"ddp": (2, []), "fsdp": (4, ["engine=fsdp", "parallel.tp=2", "parallel.dp=2"])}


def _launch(run_dir: Path, small, restarts: int, engine: str) -> subprocess.Popen:
    nproc, layout = LAYOUTS[engine]
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}",
           "--monitor-interval=0.2", TRAIN, *small, *layout, "model.d_model=128", "data.seq_len=64",
           f"trainer.max_steps={STEPS}", f"trainer.save_interval={SAVE_EVERY}", "trainer.log_interval=1",
           "model.dropout=0.1", f"hydra.run.dir={run_dir}"]
    # Restarted gloo workers must not read their dead predecessors' addresses from the agent's
    # shared store (pytorch/pytorch#135712); the launch scripts set the same.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _last_logged_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    lines = [line for line in metrics.read_text().splitlines() if '"kind": "train"' in line]
    return int(lines[-1].split('"step": ')[1].split(",")[0]) if lines else 0


def _final_weights(run_dir: Path, tmp: Path) -> dict:
    out = bd.export_dense(run_dir / "checkpoints" / "latest", tmp / f"{run_dir.name}.safetensors")
    return load_file(out)


@pytest.mark.parametrize("engine", sorted(LAYOUTS))
def test_sigkill_one_rank_then_restart_resumes_and_matches_the_uninterrupted_run(tmp_path, small, engine):
    clean = _launch(tmp_path / "clean", small, restarts=0, engine=engine)
    out, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, out

    crashed_dir = tmp_path / "crashed"
    job = _launch(crashed_dir, small, restarts=1, engine=engine)
    try:
        deadline = time.monotonic() + 300
        while _last_logged_step(crashed_dir) < KILL_AFTER:
            assert job.poll() is None and time.monotonic() < deadline, "training ended or stalled before the kill"
            time.sleep(0.01)
        workers = psutil.Process(job.pid).children(recursive=True)
        victim = max(workers, key=lambda p: p.pid)  # one training rank
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = _last_logged_step(crashed_dir)
        out, _ = job.communicate(timeout=600)
    finally:
        job.kill()
    assert killed_at < STEPS, "the kill came after training finished: the test would prove nothing"
    assert job.returncode == 0, out
    resumed_at = int(out.split("resumed from ")[1].split(" at step ")[1].split()[0])
    # The last checkpoint complete at the kill: at least one save before KILL_AFTER (the save at
    # KILL_AFTER may have been under way).
    assert KILL_AFTER - SAVE_EVERY <= resumed_at <= killed_at and resumed_at % SAVE_EVERY == 0, out

    clean_weights = _final_weights(tmp_path / "clean", tmp_path)
    resumed_weights = _final_weights(crashed_dir, tmp_path)
    assert clean_weights.keys() == resumed_weights.keys()
    for name, tensor in clean_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name
