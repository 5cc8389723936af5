"""`launch/train.py` end to end, as a user runs it: one process, torchrun, accelerate, a Hydra
sweep, resuming, and bad configs that must stop every rank with one clear message.

A small corpus (half a megabyte of the standard library, a 512-entry vocabulary, cached once per
test session) and a one-block model keep every launch to a few seconds of work.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import BIN, ROOT, TRAIN

pytestmark = pytest.mark.slow  # each case launches launch/train.py in fresh processes

LAUNCH_TIMEOUT = 300


def run(cmd, cwd=ROOT, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, **kw)
    return out.returncode, out.stdout + out.stderr


def torchrun(n, *args):
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={n}", TRAIN, *args]


def records(run_dir: Path, kind: str):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_one_process_trains_evaluates_saves_plots_and_resumes(tmp_path, small):
    run_dir = tmp_path / "run"
    code, out = run([sys.executable, TRAIN, *small, "trainer.max_steps=4", "trainer.save_interval=2",
                     "precision=bf16", "recompute=full", "trainer.log_rms=true", f"hydra.run.dir={run_dir}"])
    assert code == 0, out
    assert "mesh tp=1 x dp=1" in out
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == [2, 4]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "peak_mem_gb", "accuracy", "z_loss"):
        assert all(isinstance(r[key], float) for r in train), key
    # The fused head's counts: every target of the 2-step interval counted (plain text masks none).
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["z_loss"] == 0.0 and r["target_tokens"] > 0 for r in train), train
    for key in ("blocks.0.mlp.down/grad", "blocks.0.mlp/act_in", "blocks.0.attn.out/act_in", "head/act_in", "tok_emb/act"):
        assert train[-1][f"rms/{key}"] > 0, key
    assert records(run_dir, "eval")[-1]["step"] == 4
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "latest").exists()

    # The same run directory, a longer budget: it continues from step 4, not from scratch.
    code, out = run([sys.executable, TRAIN, *small, "trainer.max_steps=6", "precision=bf16", "recompute=full",
                     f"hydra.run.dir={run_dir}"])
    assert code == 0, out
    assert "at step 4" in out
    assert [r["step"] for r in records(run_dir, "train")] == [2, 4, 6]


def test_torchrun_two_processes_default_is_tp2_in_the_default_run_directory(tmp_path, small):
    # No hydra.run.dir: the run directory is outputs/torchrun-<rendezvous id> under the working
    # directory, one directory that both ranks share.
    code, out = run(torchrun(2, *small, "trainer.max_steps=2"), cwd=tmp_path)
    assert code == 0, out
    assert "mesh tp=2 x dp=1" in out
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("torchrun-"), runs
    assert (runs[0] / "checkpoints" / "latest").exists() and (runs[0] / "metrics.jsonl").exists()
    assert (runs[0] / "train_rank0.log").exists() and (runs[0] / "train_rank1.log").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.tp=3", "bigdense: bad config: parallel.tp=3 does not divide the number of processes (2)"),
        ("model.n_heads=1", "bigdense: bad config: parallel.tp=2 must divide model.n_heads=1"),
        ("data=files", "bigdense: bad config: data.source=files needs data.path"),
        ("optim.schedule=linear", "bigdense: bad config: optim.schedule='linear' is not one of"),
        ("engine=deepspeed precision=fp16", "bigdense: bad config: precision=fp16 with engine=deepspeed needs a GPU"),
        ("trainer.max_step=10", "bigdense: bad config: trainer.max_step is not a config key; did you mean trainer.max_steps?"),
        ("+trainer.max_step=10", "bigdense: bad config: trainer.max_step is not a config key; did you mean trainer.max_steps?"),
        ("model=gpt_huge", "In 'config': Could not find 'model/gpt_huge'"),  # Hydra's own message, the same way
    ],
)
def test_bad_config_stops_every_rank_with_one_message(tmp_path, small, override, message):
    code, out = run(torchrun(2, *small, *override.split(), f"hydra.run.dir={tmp_path}"))
    assert code != 0
    # Printed once, by rank 0, before torchrun's report, which ends with it too (its error file).
    assert out.count(message) == 2 and out.index(message) < out.index("Traceback"), out
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before any work


def test_unknown_group_option_names_the_choices(tmp_path, small):
    code, out = run([sys.executable, TRAIN, *small, "model=gpt_huge", f"hydra.run.dir={tmp_path}"])
    assert code != 0
    assert "Could not find 'model/gpt_huge'" in out and "gpt_tiny" in out


def test_accelerate_launch_single_cpu_process(tmp_path, small):
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "launch/accelerate/cpu.yaml"), TRAIN,
           *small, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"]
    code, out = run(cmd)
    assert code == 0, out
    assert len(records(tmp_path, "train")) == 1


def test_hydra_multirun_sweep(tmp_path, small):
    code, out = run([sys.executable, TRAIN, "--multirun", *small, "trainer.max_steps=2", "optim.lr=1e-3,3e-4",
                     f"hydra.sweep.dir={tmp_path}"])
    assert code == 0, out
    jobs = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert len(jobs) == 2
    lrs = {json.loads((j / ".hydra" / "config.yaml").read_text().split("lr: ")[1].split()[0]) for j in jobs}
    assert lrs == {1e-3, 3e-4}


def test_deepspeed_launcher_with_the_deepspeed_engine(tmp_path, small):
    import socket

    with socket.socket() as s:  # the launcher's rendezvous port; it insists on being told one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "deepspeed"), "--num_gpus=2", f"--master_port={port}", TRAIN, "engine=deepspeed",
           "engine.zero_stage=1", *small, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"]
    code, out = run(cmd)
    assert code == 0, out
    assert "mesh tp=2 x dp=1" in out and "engine=deepspeed" in out
    assert (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("engine", ["engine=ddp", "engine=deepspeed engine.zero_stage=1"])
def test_init_from_starts_training_from_that_checkpoints_weights(tmp_path, small, engine):
    # Saved by one process, loaded at tp=2. A near-zero learning rate: one step must leave the loaded weights where they were (Adam moves
    # each by at most about lr). An engine that kept copies made before the load (DeepSpeed's fp32
    # masters) would write the fresh initialisation back instead, moving weights by ~1e-2.
    from safetensors.torch import load_file

    import bigdense as bd

    source = tmp_path / "source"
    code, out = run([sys.executable, TRAIN, *small, "trainer.max_steps=2", "optim.lr=0.01", f"hydra.run.dir={source}"])
    assert code == 0, out
    tuned = tmp_path / "tuned"
    code, out = run(torchrun(2, *small, *engine.split(), "trainer.max_steps=1", "optim.lr=1e-9", "optim.min_lr=0",
                             f"trainer.init_from={source / 'checkpoints' / 'latest'}", f"hydra.run.dir={tuned}"))
    assert code == 0, out
    assert "model weights from" in out
    before = load_file(bd.export_dense(source / "checkpoints" / "latest", tmp_path / "before.safetensors"))
    after = load_file(bd.export_dense(tuned / "checkpoints" / "latest", tmp_path / "after.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6, msg=name)


def test_a_resume_at_another_layout_is_in_the_title_and_compress_scores_as_the_run_did(tmp_path, small):
    # tp=2 x dp=1 for 2 steps, then tp=1 x dp=2 to step 4: each launch records its layout, the loss
    # curve's title names both, and compress's loss "before" for the step-4 checkpoint is the one
    # the run logged at step 4 (its held-out set is 2 batches per DP rank: 4 batches at dp=2).
    from bigdense.compress import main as compress
    from bigdense.train.metrics import loss_curve_figure

    run_dir = tmp_path / "run"
    for layout, steps in (([], 2), (["parallel.tp=1"], 4)):
        code, out = run(torchrun(2, *small, *layout, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}"))
        assert code == 0, out
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["layout"]) for r in lines if "layout" in r] == [
        ("start", 0, {"tp": 2, "dp": 1}), ("resume", 2, {"tp": 1, "dp": 2})]
    fig = loss_curve_figure(lines, title="run: gpt d=64 x 1 layers, fp32, ddp")
    assert fig._suptitle.get_text().endswith("tp=2 x dp=1 (steps 0-2), tp=1 x dp=2 (steps 2-4)")
    fig.clear()

    assert compress([str(run_dir), "--rank", "8", "--out", str(tmp_path / "lowrank")]) == 0
    report = json.loads((tmp_path / "lowrank" / "compress_report.json").read_text())
    logged = records(run_dir, "eval")[-1]
    assert logged["step"] == 4 and report["held_out_loss_before"] == pytest.approx(logged["eval_loss"], rel=1e-6)
