"""The path a new user takes through the docs, run as written and in the order it is written, and
the errors such a user meets on it: each printed once by bigdense, on a failing exit, without a
traceback of bigdense's, first on the screen under torchrun and again as the last thing torchrun prints.

The docs' commands are taken from the pages themselves (training's fine-tune-and-export block and
its resume block, compression's compress-then-fine-tune block) and run in a temporary directory with the test corpus appended and
the step budgets scaled down (100 -> 4, 200 -> 6; 4 where a command gives none); everything else
is as the page says.
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import BIN, ROOT, TRAIN

pytestmark = pytest.mark.slow  # each case launches launch/train.py in fresh processes

STEPS = {"100": "4", "200": "6"}
TIMEOUT = 300


def run(cmd, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return out.returncode, out.stdout + out.stderr


def torchrun(*args):
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN, *args]


def docs_block(page: str, marker: str) -> list[list[str]]:
    """The commands of the ``bash`` block of ``docs/<page>`` that contains ``marker``."""
    text = (ROOT / "docs" / page).read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if marker in b)
    return [w for w in (shlex.split(line, comments=True) for line in block.splitlines()) if w]


def as_test_command(words: list[str], small: list[str]) -> list[str]:
    """A docs command as this test runs it: `make train` as the torchrun line it stands for,
    programs of .venv/bin from the running environment, the test corpus appended to training."""
    words = [re.sub(r"(trainer\.max_steps=)(\d+)", lambda m: m[1] + STEPS[m[2]], w) for w in words]
    budget = [] if "trainer.max_steps=" in " ".join(words) else ["trainer.max_steps=4"]  # the default is 200
    if words[:2] == ["make", "train"]:
        variables = dict(w.split("=", 1) for w in words[2:])
        run_dir = [f"trainer.run_dir={variables['RUN']}"] if "RUN" in variables else []
        return torchrun(*run_dir, *shlex.split(variables.get("ARGS", "")), *small, *budget)
    if words[0] == ".venv/bin/torchrun":
        return torchrun(*words[words.index("launch/train.py") + 1:], *small, *budget)
    if words[0] == ".venv/bin/python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"no rule to run {words}")


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def last_lines(out: str, n: int = 2) -> str:
    """The last ``n`` lines with words (torchrun's summary ends with a rule of '=')."""
    return "\n".join([line for line in out.splitlines() if re.search(r"\w", line)][-n:])


def test_the_docs_resume_then_compress_then_fine_tune_path_runs_in_order(tmp_path, small):
    resume = docs_block("training.md", "RUN=outputs/gpt-a")
    compress = docs_block("compression.md", "bigdense.compress")
    assert len(resume) == 5 and len(compress) == 2, (resume, compress)
    outs = []
    for words in resume + compress:
        code, out = run(as_test_command(words, small), tmp_path)
        assert code == 0, f"{shlex.join(words)}\n{out}"
        assert "Traceback" not in out, out
        outs.append(out)
    a, ft = tmp_path / "outputs" / "gpt-a", tmp_path / "outputs" / "gpt-a-ft"
    # 1. trained 4 steps; 2. nothing left: said once, nothing added; 3. extended to 6 from step 4;
    # 5. nothing left again.
    assert outs[1].count("nothing to train") == 1 and outs[4].count("nothing to train") == 1, outs[1]
    assert [r["step"] for r in records(a, "eval")] == [4, 6]
    assert [r["step"] for r in records(a, "resume")] == [4]
    assert "resumed from" in outs[2] and "at step 4 of 6" in outs[2]
    assert (tmp_path / "outputs" / "gpt-b" / "checkpoints" / "latest").exists()
    # 6. compressed; 7. fine-tuned from it, the low-rank structure taken from the checkpoint.
    report = json.loads((tmp_path / "outputs" / "gpt-a-lowrank" / "compress_report.json").read_text())
    assert report["low_rank"] and all(k.startswith("blocks.") and ".mlp." in k for k in report["low_rank"])
    assert "model.low_rank from trainer.init_from=outputs/gpt-a-lowrank" in outs[6]
    assert [r["step"] for r in records(ft, "eval")][-1] == 4
    assert "run directory" in outs[6] and "checkpoint(s)" in outs[6]
    # A named run directory without a checkpoint says that a run starts there; gpt-b, one edit from
    # gpt-a (a typo, maybe), names it.
    assert "trainer.run_dir=outputs/gpt-a holds no checkpoint: a new run starts there from step 0\n" in outs[0]
    assert ("trainer.run_dir=outputs/gpt-b holds no checkpoint: a new run starts there from step 0; outputs/gpt-a "
            "(one edit away) holds a run with checkpoints: trainer.run_dir=outputs/gpt-a resumes it") in outs[3]
    # compress's "before" is the loss the run logged at that checkpoint's step, and the fine-tune it
    # prints is a command as the docs write them, which runs as printed.
    assert report["held_out_loss_before"] == pytest.approx(records(a, "eval")[-1]["eval_loss"], rel=1e-5)
    printed = shlex.split(next(line for line in outs[5].splitlines() if line.startswith("  .venv/bin/torchrun")))
    assert printed[:5] == [".venv/bin/torchrun", "--standalone", "--nproc_per_node=2", "launch/train.py",
                           "trainer.init_from=outputs/gpt-a-lowrank"], printed
    as_here = [str(BIN / "torchrun"), *[TRAIN if w == "launch/train.py" else w for w in printed[1:]]]  # cwd: tmp_path
    code, out = run([*as_here, "trainer.max_steps=2"], tmp_path)
    assert code == 0 and "model.low_rank from trainer.init_from=outputs/gpt-a-lowrank" in out, out
    assert [r["step"] for r in records(tmp_path / "outputs" / "gpt-a-lowrank-ft", "eval")] == [2]


def test_the_docs_hugging_face_fine_tune_then_export_runs_as_written(tmp_path, small):
    block = docs_block("training.md", "model=hf")
    assert [w[:3] for w in block] == [[".venv/bin/python", "-m", "bigdense.testing.pretrained"],
                                      [".venv/bin/torchrun", "--standalone", "--nproc_per_node=2"],
                                      [".venv/bin/python", "-m", "bigdense.export_hf"]], block
    for words in block:
        code, out = run(as_test_command(words, small), tmp_path)
        assert code == 0 and "Traceback" not in out, f"{shlex.join(words)}\n{out}"
    run_dir, exported = tmp_path / "outputs" / "llama-ft", tmp_path / "outputs" / "llama-ft-hf"
    assert [r["step"] for r in records(run_dir, "eval")] == [4]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(exported).eos_token == "</s>"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small):
    """A run directory with one checkpoint, trained at tp=2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    code, out = run(torchrun(*small, "trainer.max_steps=2", f"trainer.run_dir={run_dir}"), ROOT)
    assert code == 0, out
    return run_dir


def test_init_from_takes_a_run_directory(trained, tmp_path, small):
    code, out = run(torchrun(*small, "trainer.max_steps=1", f"trainer.init_from={trained}",
                             f"trainer.run_dir={tmp_path / 'tuned'}"), ROOT)
    assert code == 0, out
    assert f"model weights from {trained / 'checkpoints' / 'step_0000002'}" in out


@pytest.mark.parametrize("case", ["init_from_no_checkpoint", "init_from_run_without_checkpoint", "resume_other_model",
                                  "init_from_other_model", "heads_advice"])
def test_user_errors_are_one_message_last_and_no_traceback(trained, tmp_path, small, case):
    empty_run = tmp_path / "empty"
    (empty_run / "checkpoints").mkdir(parents=True)
    overrides, message = {
        "init_from_no_checkpoint": ([f"trainer.init_from={ROOT / 'launch'}"],
                                    f"bigdense: bad config: trainer.init_from='{ROOT / 'launch'}': {ROOT / 'launch'} "
                                    f"is not a bigdense checkpoint (no manifest.json); give a checkpoint directory"),
        "init_from_run_without_checkpoint": ([f"trainer.init_from={empty_run}"],
                                             f"{empty_run} is a run directory, but {empty_run / 'checkpoints'} holds "
                                             f"no complete checkpoint yet"),
        "resume_other_model": ([f"trainer.run_dir={trained}", "model.activation=swiglu", "trainer.max_steps=3"],
                               f"bigdense: checkpoint: cannot resume {trained}: its checkpoints are of another model "
                               f"(model.activation='gelu' in the checkpoint, 'swiglu' here). To train this model, "
                               f"start in a new trainer.run_dir"),
        "init_from_other_model": ([f"trainer.init_from={trained}", "model.d_model=32"],
                                  f"bigdense: checkpoint: trainer.init_from={trained} holds another model's weights: "
                                  f"model.d_model=64 in the checkpoint, 32 here"),
        "heads_advice": (["model.n_heads=3", "model.d_model=48"],
                         "bigdense: bad config: parallel.tp=2 must divide model.n_heads=3 (heads are split over TP); "
                         "choose parallel.tp from [1] (divisors of both the heads and the 2 processes)"),
    }[case]
    code, out = run(torchrun(*small, *overrides), tmp_path)
    # Rank 0's own line comes before torchrun's report (its stack trace), whose summary ends with it.
    assert code != 0 and out.count(message) == 2 and out.index(message) < out.index("Traceback"), out
    assert message in last_lines(out), out
    assert "Error executing job" not in out and not re.search(r'File ".*/bigdense/', out), out  # no traceback
    # A config checked before the run directory is made leaves none behind; a run directory made
    # before the error says in its log why the launch ended.
    made = sorted((tmp_path / "outputs").glob("torchrun-*"))
    if case in ("init_from_no_checkpoint", "init_from_run_without_checkpoint", "heads_advice"):
        assert made == [], [p for d in made for p in d.rglob("*")]
    else:
        (run_dir,) = made or [trained]
        assert message in (run_dir / "train_rank0.log").read_text()
