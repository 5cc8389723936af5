"""python -m bigdense.compress: a checkpoint saved at tp=2 compressed in one process, the result
loaded at tp=2 again (and fine-tuned through launch/train.py), the report's figures checked.

Losses of the same weights at different TP sizes differ only by the order of fp32 sums (the
row-parallel all-reduces): 1e-5 relative on a loss of about 6.
"""
import json
import shlex
import subprocess
import sys

import pytest
import torch

import bigdense as bd
from bigdense.compress import load_reference_gpt, main
from bigdense.plan.__main__ import DEFAULT_CONF, compose
from bigdense.testing import run_ranks
from helpers import ROOT, TRAIN


def _save_initial(overrides, path, tp=2):
    from bigdense.jobs import build_gpt

    cfg = compose(overrides, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = build_gpt(cfg, cfg.data.vocab_size, ctx)
    bd.save_checkpoint(path, model, step=0, config=cfg)


def _held_out_loss(path):
    from bigdense.compress import held_out_loss

    ctx = bd.init_parallel(tp=2)
    model, cfg, _ = load_reference_gpt(path, ctx)
    assert isinstance(model.blocks[0].mlp.up, torch.nn.Sequential)  # built as the low-rank structure
    return held_out_loss(model, cfg, ctx, 2)


@pytest.fixture
def checkpoint(tmp_path, small):
    path = tmp_path / "ckpt"
    overrides = [*small, "model.n_layers=2", "model.d_model=96", "model.n_heads=2", "trainer.eval_batches=2"]
    run_ranks(_save_initial, 2, overrides, path)
    return path


@pytest.fixture
def dp2_checkpoint(tmp_path, small):
    """A checkpoint saved at tp=1 x dp=2: a run whose held-out set is two batches per DP rank."""
    path = tmp_path / "ckpt-dp2"
    run_ranks(_save_initial, 2, [*small, "trainer.eval_batches=2", "model.dropout=0.2"], path, 1)
    return path


def _as_the_run_evaluated(path, dp):
    """The held-out loss as each of the run's ``dp`` DP ranks computed its part (eval mode, its own
    batches) and the run averaged them: written out here, apart from the library's evaluation."""
    from bigdense.data import prepare_data

    ctx = bd.init_parallel(tp=1)
    model, cfg, _ = load_reference_gpt(path, ctx)
    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    model.eval()
    with torch.no_grad():
        per_rank = [[float(model(x, y)) for x, y in data.val_batches(cfg.trainer.eval_batches, r, dp)]
                    for r in range(dp)]
    return sum(map(sum, per_rank)) / sum(map(len, per_rank))


def test_the_loss_before_is_the_runs_own_held_out_loss_at_its_layout(dp2_checkpoint, tmp_path, small):
    # The run evaluated 2 batches on each of its 2 DP ranks; compress, in one process, evaluates the
    # same 4 batches (not the 2 of a one-rank run), with dropout off, as the run did.
    out = tmp_path / "compressed"
    assert main([str(dp2_checkpoint), "--rank", "8", "--out", str(out)]) == 0
    report = json.loads((out / "compress_report.json").read_text())
    assert report["held_out_loss_before"] == pytest.approx(_as_the_run_evaluated(dp2_checkpoint, 2), rel=1e-6)
    # The fine-tune as the docs write commands: the run's 2 processes and layout, its model and data settings.
    command = report["fine_tune_command"]
    assert command[:5] == [".venv/bin/torchrun", "--standalone", "--nproc_per_node=2", "launch/train.py",
                           f"trainer.init_from={out}"]
    assert command[-1] == f"trainer.run_dir={out}-ft" and "parallel.tp=1" in command
    assert set(small) - {"trainer.eval_batches=2", "trainer.log_interval=2", "trainer.progress_bar=false",
                         "optim.warmup_steps=2"} <= set(command)  # the data and model keys, not the trainer's
    assert "model.dropout=0.2" in command and not any(w.startswith(("trainer.eval", "optim.")) for w in command)


def test_compress_writes_a_checkpoint_and_report_that_loads_at_another_tp(checkpoint, tmp_path, capsys):
    out = tmp_path / "compressed"
    assert main([str(checkpoint), "--energy", "0.9", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "compress_report.json").read_text())
    assert "held-out loss" in printed and f"\n  {shlex.join(report['fine_tune_command'])}" in printed
    layers = {r["layer"]: r for r in report["layers"]}
    assert set(layers) == {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")}
    for r in report["layers"]:
        assert 1 <= r["rank"] <= min(r["in"], r["out"])
        assert r["kept"] or r["params_after"] < r["params_before"]
        assert r["flops_per_token_after"] <= r["flops_per_token_before"]
        # Energy 0.9 keeps 90% of ||W||^2, so the rest is at most 10%: error <= sqrt(0.1) (+ rounding).
        assert 0 <= r["relative_frobenius_error"] <= 0.1**0.5 + 1e-4
        assert r["forward_ms_before"] > 0 and r["forward_ms_after"] > 0
    assert report["params_after"] < report["params_before"]
    assert report["held_out_loss_before"] > 0 and report["held_out_loss_after"] > 0
    # The compressed checkpoint, saved at tp=1, loads at tp=2 into the low-rank structure.
    for loss in run_ranks(_held_out_loss, 2, out):
        assert loss == pytest.approx(report["held_out_loss_after"], rel=1e-5)


def _reloaded(path):
    """At tp=2: the held-out loss of a compressed checkpoint, and the structure it was built in."""
    from bigdense.compress import held_out_loss

    ctx = bd.init_parallel(tp=2)
    model, cfg, _ = load_reference_gpt(path, ctx)
    mlp = model.blocks[0].mlp
    return held_out_loss(model, cfg, ctx, 2), type(mlp.up).__name__, mlp.d_hidden, hasattr(mlp.up, "weight_mask")


@pytest.mark.parametrize("args, expect", [
    (["--prune", "0.5", "--structure", "rows"], ("ColumnParallelLinear", 192, False)),
    (["--prune", "0.7"], ("ColumnParallelLinear", 384, True)),
    (["--int8"], ("Int8Linear", 384, False)),
], ids=["rows", "unstructured", "int8"])
def test_compress_prune_and_int8_write_checkpoints_that_load_at_another_tp(checkpoint, tmp_path, args, expect):
    out = tmp_path / "compressed"
    assert main([str(checkpoint), *args, "--out", str(out)]) == 0
    report = json.loads((out / "compress_report.json").read_text())
    for r in report["layers"]:
        assert r["forward_ms_before"] > 0 and r["forward_ms_after"] > 0 and r["flops_per_token_after"] > 0
        assert 0 <= r["relative_frobenius_error"] < 1
    if "rows" in args:  # every block's MLP halved: 384 -> 192 hidden units, recorded for the fine-tune
        assert report["d_hidden"] == 192 and {r["layer"] for r in report["layers"]} == {
            f"blocks.{i}.mlp.{n}" for i in range(2) for n in ("up", "down")}
        assert all(r["params_after"] < r["params_before"] for r in report["layers"])
        assert report["fine_tune_overrides"] == [f"trainer.init_from={out}"]
    elif "--int8" in args:  # int8's error: about max|w| / 127 / sqrt(12) per weight, under 1%
        assert all(r["relative_frobenius_error"] < 0.01 and r["weight_bytes_after"] < r["weight_bytes_before"] / 3
                   for r in report["layers"])
        assert abs(report["held_out_loss_after"] - report["held_out_loss_before"]) < 0.01
    else:  # one global threshold: 70% of the blocks' weights gone in all (per layer it varies)
        kept = sum(r["params_after"] - r["out"] for r in report["layers"])  # nonzero weights (every layer has a bias)
        assert kept == pytest.approx(0.3 * sum(r["in"] * r["out"] for r in report["layers"]), abs=1)
        assert all(r["sparse_format"] in (None, "csr") for r in report["layers"])
    for loss, *structure in run_ranks(_reloaded, 2, out):
        assert loss == pytest.approx(report["held_out_loss_after"], rel=1e-5)
        assert tuple(structure) == expect


def test_compress_bad_input(checkpoint, tmp_path, capsys):
    assert main([str(checkpoint), "--energy", "1.5"]) == 2
    assert "energy must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main([str(checkpoint), "--rank", "3", "--layers", "encoder.*", "--eval-batches", "0"]) == 2
    assert "--layers 'encoder.*' matches no dense layer" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing"), "--rank", "3"]) == 2
    assert not (tmp_path / "nothing-lowrank-r3").exists()
    assert main([str(checkpoint), "--prune", "1.5"]) == 2
    assert "sparsity must be a number in [0, 1]" in capsys.readouterr().err
    assert main([str(checkpoint), "--prune", "0.5", "--structure", "rows", "--layers", "blocks.0.*",
                 "--eval-batches", "0"]) == 2
    assert "shrinks every block's MLP alike" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("args, adopted", [(["--rank", "8"], "model.low_rank from"),
                                           (["--prune", "0.5", "--structure", "rows"], "model.d_hidden=192 from"),
                                           (["--prune", "0.7"], None)],
                         ids=["lowrank", "rows", "unstructured"])
def test_compressed_checkpoint_fine_tunes_in_launch_train(checkpoint, tmp_path, small, args, adopted):
    out = tmp_path / "compressed"
    assert main([str(checkpoint), *args, "--eval-batches", "0", "--out", str(out)]) == 0
    report = json.loads((out / "compress_report.json").read_text())
    cmd = [sys.executable, TRAIN, *small, "model.n_layers=2", "model.d_model=96", "model.n_heads=2",
           *report["fine_tune_overrides"], "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model weights from {out}" in done.stdout + done.stderr
    if adopted:
        assert f"{adopted} trainer.init_from={out}" in done.stdout + done.stderr
    else:  # the masks came with the weights, and the fine-tune kept the pruned weights zero
        from safetensors.torch import load_file

        import bigdense as bd

        (latest,) = (tmp_path / "run").rglob("latest")
        exported = load_file(bd.export_dense(latest, tmp_path / "ft.safetensors"))
        masks = {k: v for k, v in exported.items() if k.endswith(".weight_mask")}
        assert masks and all(not exported[k.replace("_mask", "")][~v].any() for k, v in masks.items())
