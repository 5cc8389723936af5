"""What a launch says or leaves behind before it trains: a named run directory without a
checkpoint (a typo of another run's name starts over), a precision this CPU emulates, a bad config
(no run directory left behind), and DeepSpeed loaded only by what uses it.

`start_run` is called in this process on a composed config (one rank); the launch and import
checks run in fresh processes, since what they check is a process's own state.
"""
import json
import logging
import subprocess
import sys

import pytest
import torch

import bigdense as bd
from bigdense.jobs.setup import edit_distance, start_run
from bigdense.plan.__main__ import DEFAULT_CONF, compose
from helpers import ROOT, TRAIN

TIMEOUT = 300


def _start(tmp_path, overrides, run_dir):
    cfg = compose(overrides, DEFAULT_CONF)
    run = start_run(cfg, str(run_dir))
    bd.destroy_parallel()
    return run


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "bigdense" and r.levelno == level]


def test_edit_distance():
    assert edit_distance("gpt-a", "gpt-a") == 0
    assert edit_distance("gpt-aa", "gpt-a") == edit_distance("gpt-a", "gpt-b") == edit_distance("gpt-a", "gt-a") == 1
    assert edit_distance("gpt-a", "gpt-abc") == 2 and edit_distance("", "abc") == 3


def test_a_named_run_directory_without_checkpoint_says_a_new_run_starts_and_names_the_run_one_edit_away(
        tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    for name in ("gpt-a", "gpt-abc"):  # a run one edit away from gpt-aa, and one two edits away
        (tmp_path / "outputs" / name / "checkpoints").mkdir(parents=True)
        (tmp_path / "outputs" / name / "checkpoints" / "latest").write_text("step_0000004\n")
    (tmp_path / "outputs" / "gpt-ab").mkdir()  # one edit away, but no run: no checkpoint
    caplog.set_level(logging.INFO, logger="bigdense")
    _start(tmp_path, ["trainer.run_dir=outputs/gpt-aa"], tmp_path / "outputs" / "gpt-aa")
    (said,) = _messages(caplog, logging.WARNING)
    assert said == ("trainer.run_dir=outputs/gpt-aa holds no checkpoint: a new run starts there from step 0; "
                    "outputs/gpt-a (one edit away) holds a run with checkpoints: trainer.run_dir=outputs/gpt-a "
                    "resumes it")

    caplog.clear()  # a run directory that holds a checkpoint resumes: nothing to say here
    _start(tmp_path, ["trainer.run_dir=outputs/gpt-a"], tmp_path / "outputs" / "gpt-a")
    assert not [m for m in _messages(caplog, logging.INFO) + _messages(caplog, logging.WARNING) if "run_dir" in m]

    caplog.clear()  # nothing near: said plainly, as information
    _start(tmp_path, ["trainer.run_dir=outputs/fresh"], tmp_path / "outputs" / "fresh")
    assert "trainer.run_dir=outputs/fresh holds no checkpoint: a new run starts there from step 0" in \
        _messages(caplog, logging.INFO)
    assert not _messages(caplog, logging.WARNING)


@pytest.mark.parametrize("dtype,capabilities,warned", [
    ("bf16", {"avx512_bf16": False, "amx_bf16": False}, True),
    ("fp16", {"avx512_fp16": False, "amx_fp16": False, "avx512_bf16": True}, True),
    ("bf16", {"avx512_bf16": True}, False),
    ("bf16", {"amx_bf16": True}, False),
    ("fp32", {}, False),
])
def test_a_cpu_run_in_a_precision_the_cpu_emulates_warns_once(tmp_path, monkeypatch, caplog, dtype, capabilities,
                                                              warned):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    caplog.set_level(logging.INFO, logger="bigdense")
    _start(tmp_path, [f"precision={dtype}"], tmp_path / "run")
    said = [m for m in _messages(caplog, logging.WARNING) if "emulates" in m]
    if warned:
        assert len(said) == 1, said
        assert said[0].startswith(f"precision={dtype} on a CPU without native {dtype} matrix multiplies") and \
            "several times slower than with precision=fp32" in said[0]
    else:
        assert not said


def test_the_warning_is_for_cpus_only():
    from bigdense.train.precision import cpu_emulates, warn_if_cpu_emulates

    assert cpu_emulates("bf16", {}) and not cpu_emulates("fp32", {})
    warn_if_cpu_emulates("bf16", "meta")  # not a CPU: nothing to say, nothing read


def _run(cmd, cwd):
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return done.returncode, done.stdout + done.stderr


def test_a_bad_config_leaves_no_run_directory(tmp_path, small):
    # Checked before Hydra makes the run directory (outputs/<date>/<time> here): nothing is left.
    code, out = _run([sys.executable, TRAIN, *small, "parallel.tp=3"], tmp_path)
    message = "bigdense: bad config: parallel.tp=3 does not divide the number of processes"
    assert code == 2 and out.count(message) == 1, out
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


@pytest.mark.parametrize("override,message", [
    ("trainer.cuda_graphs=true", "bigdense: bad config: trainer.cuda_graphs=true cannot be used here: CUDA graphs "
                                 "record GPU kernels; this run is on cpu"),
    ("trainer.compile=graph", "bigdense: bad config: trainer.compile='graph' is not one of ['false', 'blocks', 'model']"),
])
def test_compile_and_cuda_graph_keys_are_checked_before_anything_runs(tmp_path, small, override, message):
    # One line naming the key, exit code 2, nothing written.
    code, out = _run([sys.executable, TRAIN, *small, override], tmp_path)
    assert code == 2 and out.count(message) == 1, out
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_trainer_compile_spellings():
    from bigdense.errors import ConfigError
    from bigdense.train.compile import compile_mode

    # true is the key's former boolean: per-block compile, as before.
    assert [compile_mode(v) for v in (False, None, "none", True, "true", "blocks", "model")] == \
        ["false", "false", "false", "blocks", "blocks", "blocks", "model"]
    with pytest.raises(ConfigError, match="trainer.compile"):
        compile_mode("graphs")


DEEPSPEED_FREE = """
import json, sys
from bigdense.jobs import build_gpt, parallelize_model, start_run
from bigdense.plan.__main__ import DEFAULT_CONF, compose
import bigdense as bd
small, run_dir = json.loads(sys.argv[1]), sys.argv[2]
for engine in ("ddp", "fsdp"):
    cfg = compose([*small, f"engine={engine}"], DEFAULT_CONF)
    run = start_run(cfg, run_dir)
    parallelize_model(build_gpt(cfg, cfg.data.vocab_size, run.ctx), run.ctx, cfg)
    bd.destroy_parallel()
import bigdense.testing.pretrained as pretrained
pretrained.write_pretrained(run_dir + "/tiny-llama")
print("deepspeed loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")[:3])
"""


def test_nothing_that_does_not_use_deepspeed_loads_it(tmp_path, small):
    # `import bigdense`, the DDP and FSDP jobs' setup (engines included), and writing a small Hugging
    # Face checkpoint (`python -m bigdense.testing.pretrained`, through transformers' save_pretrained).
    code, out = _run([sys.executable, "-c", DEEPSPEED_FREE, json.dumps(small), str(tmp_path)], ROOT)
    assert code == 0, out
    assert "deepspeed loaded: []" in out and "Setting accelerator" not in out, out
