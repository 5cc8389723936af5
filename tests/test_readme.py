"""The README's and the docs' commands and examples are the ones that work, as written, after
`make train` or `make test` created `.venv`.

Every command of the ``bash`` blocks of README.md and docs/*.md must resolve: a make target of the
Makefile, a program of ``.venv/bin``, an executable script of the repository, or a cluster's
scheduler (``sbatch``) given a script of the repository; the scripts and modules it names exist; its
Hydra overrides use keys the schemas define and options ``conf/`` has, and compose. The cheap
commands are run. Each ``python`` block is an excerpt of a runnable file of ``examples/``, and those
files are run alone and under torchrun. Every relative link leads to a file, and every docs page is
linked from the README.
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from bigdense.config import check_override_keys, register_configs
from helpers import BIN, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {path.relative_to(ROOT).as_posix(): path.read_text() for path in PAGES}
README = TEXTS["README.md"]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
LAUNCH_TIMEOUT = 300
# Scripts that pass their arguments on to launch/train.py as Hydra overrides.
TRAINING_SCRIPTS = ("launch/train.py", "launch/torchrun_multinode.sh", "launch/slurm.sbatch")


def blocks(lang: str) -> list[str]:
    """The ``lang`` code blocks of the README and every docs page."""
    return [b for text in TEXTS.values() for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]


def readme_commands() -> list[list[str]]:
    commands = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def venv_bin(name: str):
    """A program of `.venv/bin`; the running environment's when the tests run elsewhere."""
    local = ROOT / ".venv" / "bin" / name
    return local if (ROOT / ".venv").exists() else BIN / name


def code_lines(text: str) -> list[str]:
    """Lines of code without their trailing comments, for comparing an excerpt with its source."""
    out = []
    for line in text.splitlines():
        code = line.split("  #")[0].strip()
        if code and not code.startswith("#"):
            out.append(code)
    return out


def check_resolves(words: list[str]) -> None:
    cmd = " ".join(words)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment assignments
        words = words[1:]
    prog, args = words[0], words[1:]
    if prog == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert all(a in targets for a in args if "=" not in a), f"{cmd}: not a make target of {targets}"
        variables = dict(a.split("=", 1) for a in args if "=" in a)
        assert set(variables) <= set(re.findall(r"^(\w+) \?=", (ROOT / "Makefile").read_text(), re.M)), cmd
        check_override_keys(shlex.split(variables.get("ARGS", "")))
        return
    if prog.startswith(".venv/bin/"):
        assert venv_bin(prog[len(".venv/bin/"):]).exists(), f"{cmd}: {prog} is not installed by `make setup`"
    elif prog.startswith("./"):
        assert os.access(ROOT / prog, os.X_OK), f"{cmd}: {prog} is not an executable file of the repository"
    elif prog != "sbatch":
        pytest.fail(f"{cmd}: {prog!r} is not found from a fresh shell; use .venv/bin/{prog} or a make target")
    if "-m" in args:
        module = args[args.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, f"{cmd}: no module {module}"
    scripts = [a for a in args + [prog] if re.search(r"\.(py|sh|sbatch|yaml)$", a)]
    for script in scripts:
        assert (ROOT / script).exists(), f"{cmd}: {script} does not exist"
    trainer = [a for a in [prog, *args] if a.lstrip("./") in TRAINING_SCRIPTS]
    if trainer:
        overrides = [a for a in args[args.index(trainer[0]) + 1 if trainer[0] in args else 0:]
                     if "=" in a and not a.startswith("-")]
        check_override_keys(overrides)
        for override in overrides:
            key, value = override.split("=", 1)
            if "." not in key and not key.startswith(("+", "~", "hydra")):  # a group option
                assert (ROOT / "conf" / key / f"{value}.yaml").exists(), f"{cmd}: no option conf/{key}/{value}.yaml"
        if "--multirun" not in args and "-m" not in args:
            compose(overrides)


def compose(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hydra_compose(config_name="config", overrides=overrides)


def test_every_readme_command_resolves():
    commands = readme_commands()
    assert any(c[:2] == ["make", "train"] for c in commands) and any(c[:2] == ["make", "test"] for c in commands)
    for words in commands:
        check_resolves(words)


def test_every_relative_link_leads_to_a_file():
    for page, text in TEXTS.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert ((ROOT / page).parent / target).exists(), f"{page}: the link to {target} leads nowhere"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[^)#]+)", README))
    pages = {p for p in TEXTS if p.startswith("docs/")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_a_bare_command_would_be_caught():
    with pytest.raises(pytest.fail.Exception, match="not found from a fresh shell"):
        check_resolves(["torchrun", "--standalone", "launch/train.py"])
    with pytest.raises(Exception, match="did you mean trainer.max_steps"):
        check_resolves([".venv/bin/python", "launch/train.py", "trainer.max_step=3"])


def test_readme_one_process_command_runs(tmp_path, small):
    """The README's one-process line, as written, with the test corpus and two steps appended."""
    line = next(c for c in readme_commands() if c[:2] == [".venv/bin/python", "launch/train.py"] and "--multirun" not in c)
    cmd = [str(venv_bin("python")), *line[1:], *small, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_python_blocks_are_excerpts_of_runnable_examples():
    source = {line for path in EXAMPLES for line in code_lines(path.read_text())}
    python_blocks = blocks("python")
    assert python_blocks
    for block in python_blocks:
        missing = [line for line in code_lines(block) if line not in source]
        assert not missing, f"docs lines that no file of examples/ runs: {missing}"


def run_example(prefix, example, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([*prefix, str(example), str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_alone(example, tmp_path):
    out = run_example([sys.executable], example, tmp_path)
    assert "tp=1:" in out or "torchrun" not in example.read_text(), out


@pytest.mark.slow
@pytest.mark.parametrize("example", [p for p in EXAMPLES if "torchrun" in p.read_text()], ids=lambda p: p.name)
def test_example_runs_under_torchrun(example, tmp_path):
    out = run_example([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"], example, tmp_path)
    assert "tp=2:" in out
