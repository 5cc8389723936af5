"""AdamW against Muon on the reference GPT: a short learning-rate sweep for each, then the pair at
each one's best learning rate, on the same data, seed and config.

    python -m bigdense.bench.optim_compare                  # 3 LRs x 2 optimizers at 60 steps, the pair at 300
    python -m bigdense.bench.optim_compare --steps 250 --sweep-steps 50 --lrs 3e-4 1e-3 3e-3 1e-2 3e-2 \\
        --run-root /tmp/muon_compare/runs --json /tmp/muon_compare/optim_compare.json \\
        --figure docs/img/muon_vs_adamw.svg                 # docs/training.md's "AdamW against Muon"
    python -m bigdense.bench.optim_compare --steps 4 --lrs 1e-3 -- model.n_layers=1   # Hydra overrides follow --

Every run is the real job, ``launch/train.py`` in a subprocess (``--nproc 2``: under torchrun, tp=2),
in its own run directory under ``--run-root``; its ``metrics.jsonl`` gives the training-loss curve
(logged every step), the held-out loss at the end (``trainer.eval_batches`` batches), and the
wall-clock per step (``step_time_s``, the first step left out): the median, and the fastest tenth
(p10), which other jobs on a shared machine inflate least. Each run's ``optim.min_lr`` is a tenth of
its ``optim.lr`` (the configs' ratio), so every LR gets the same schedule shape; the checkpoint is
written at the end only, so no background save slows a timed step. The sweep runs the two
optimizers in turn at each LR and the final pair back to back, so that their step times are taken
under much the same machine load; each run records a digest of the code it ran (``source``), which
differs between runs where someone edited the tree meanwhile. An LR is picked by held-out loss after
``--sweep-steps`` steps; a sweep of a single LR is skipped. A run directory that holds its run
finished is read again, not retrained: the same command with one more LR in ``--lrs`` (and the same
``--run-root``) trains only what it has not finished there. Writes ``--json`` (every run) and
``--figure`` (both final training-loss curves, raw and smoothed, SVG or PNG by its suffix) and
prints the sweep and the final tables; ``--report-from`` rebuilds them from a previous ``--json``'s
run directories, training nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train.py"
OPTIMIZERS = ("adamw", "muon")
NAMES = {"adamw": "AdamW", "muon": "Muon"}
LAST_STEPS = 10  # the final training loss: the mean of the last steps' losses (one step's is noisy)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of the final pair")
    p.add_argument("--sweep-steps", type=int, default=None, help="steps of each sweep run (default: steps / 5)")
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3], help="the LRs each optimizer tries")
    p.add_argument("--nproc", type=int, default=1, help="processes per run: 1 (plain python, tp=1) or more (torchrun)")
    p.add_argument("--run-root", type=Path, default=None, help="where the run directories go (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    p.add_argument("--figure", type=Path, default=None, help="the final pair's loss curves (.svg or .png)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--report-from", type=Path, default=None,
                   help="train nothing: rebuild the tables, --json and --figure from the run directories a "
                        "previous --json lists")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    if args.sweep_steps is None:
        args.sweep_steps = max(1, args.steps // 5)
    return args


# ---- one run: the job in a subprocess, then its metrics ----
def train_command(optimizer: str, lr: float, steps: int, run_dir: Path, overrides, nproc: int) -> list[str]:
    """``launch/train.py`` for one run; the caller's ``overrides`` come last, so they win."""
    launcher = ([str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    return [*launcher, str(TRAIN), f"optim={optimizer}", f"optim.lr={lr:g}", f"optim.min_lr={lr / 10:g}",
            f"trainer.max_steps={steps}", "trainer.log_interval=1", "trainer.eval_interval=0",
            "trainer.save_interval=0", "trainer.progress_bar=false", "trainer.plot=false",
            f"trainer.run_dir={run_dir}", *overrides]


def launch_run(stage: str, optimizer: str, lr: float, steps: int, args) -> dict:
    """Train one run to the end in a fresh run directory and return its record (`read_run`). A
    directory that holds this run finished (an earlier launch of the same command, before more LRs
    were added) is read instead of trained again; one that holds anything else is refused."""
    run_dir = args.run_root / f"{stage}-{optimizer}-lr{lr:g}-{steps}steps"
    cmd = train_command(optimizer, lr, steps, run_dir, args.overrides, args.nproc)
    record = {"stage": stage, "optimizer": optimizer, "lr": lr, "steps": steps, "run_dir": str(run_dir),
              "command": " ".join(cmd)}
    if finished(run_dir, steps):
        launch = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
        record.update({"returncode": 0, "wall_s": None, "source": None, **launch, "reused": True})
    elif run_dir.exists():
        raise SystemExit(f"{run_dir} holds an unfinished run: it would resume, not start; pick another --run-root")
    else:
        record.update(train(cmd, run_dir, args.timeout))
    record.update(read_run(run_dir))
    print(f"  {stage:5s} {NAMES[optimizer]:5s} lr {lr:<7g} {steps:4d} steps: held-out {record['held_out_loss']:.4f}, "
          f"{record['ms_per_step']:.0f} ms/step" + (", read again" if record.get("reused") else
                                                    f", {record['wall_s']:.0f} s")
          + ("" if record["returncode"] == 0 else f" (exit {record['returncode']}: {run_dir}/launch.log)"), flush=True)
    return record


def train(cmd: list[str], run_dir: Path, timeout: float) -> dict:
    """Run ``cmd``; its output goes to ``launch.log``, its exit status and wall time to ``run.json``."""
    source = source_digest()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    launch = {"returncode": out.returncode, "wall_s": time.perf_counter() - start, "source": source}
    run_dir.mkdir(parents=True, exist_ok=True)  # a run that failed before Hydra made it still keeps its log
    (run_dir / "launch.log").write_text(out.stdout + out.stderr)
    (run_dir / "run.json").write_text(json.dumps(launch) + "\n")
    return launch


def finished(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir``'s metrics hold the held-out loss after its last step, ``steps``."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return any(r.get("kind") == "eval" and r.get("step") == steps for r in records)


def source_digest() -> str:
    """A digest of the code and configs a launch may import (bigdense/ but its benchmarks, conf/,
    launch/train.py): runs of one comparison share it, unless someone edits the tree meanwhile."""
    h = hashlib.sha256()
    code = [p for p in ROOT.glob("bigdense/**/*.py") if "bench" not in p.relative_to(ROOT).parts]
    for path in sorted([*code, *ROOT.glob("conf/**/*.yaml"), TRAIN]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def read_run(run_dir: Path) -> dict:
    """From ``metrics.jsonl``: the training-loss curve ``[[step, loss], ...]``, the held-out loss at
    the last step, the mean loss of the last `LAST_STEPS` steps, the median and the fastest tenth
    (p10) of the step times (ms) after the first step (NaN for what the file lacks)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    logged = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    curve = [[r["step"], r["loss"]] for r in logged]
    times = sorted(r["step_time_s"] for r in logged if r["step"] > 1) or [r["step_time_s"] for r in logged]
    last = [loss for _, loss in curve[-LAST_STEPS:]]
    nan = float("nan")
    return {"curve": curve, "held_out_loss": evals[-1]["eval_loss"] if evals else nan,
            "final_train_loss": sum(last) / len(last) if last else nan,
            "ms_per_step": 1e3 * statistics.median(times) if times else nan,
            "ms_per_step_p10": 1e3 * times[len(times) // 10] if times else nan}


# ---- the sweep and the final pair ----
def sweep(args) -> list[dict]:
    """Each LR for both optimizers in turn (none when there is one LR: it is the pick)."""
    if len(args.lrs) == 1:
        return []
    print(f"sweep: {len(args.lrs)} LRs x {len(OPTIMIZERS)} optimizers, {args.sweep_steps} steps each", flush=True)
    return [launch_run("sweep", opt, lr, args.sweep_steps, args) for lr in args.lrs for opt in OPTIMIZERS]


def best_lr(runs: list[dict], optimizer: str, lrs) -> float:
    """The LR of ``optimizer``'s sweep run with the lowest finite held-out loss (the only LR without a sweep)."""
    scored = [r for r in runs if r["optimizer"] == optimizer and math.isfinite(r["held_out_loss"])]
    if not scored:
        if len(lrs) == 1:
            return lrs[0]
        raise SystemExit(f"no {NAMES[optimizer]} sweep run finished with a finite held-out loss")
    return min(scored, key=lambda r: r["held_out_loss"])["lr"]


def final_pair(tuned: dict, args) -> list[dict]:
    print(f"final pair: {args.steps} steps, " + ", ".join(f"{NAMES[o]} lr {lr:g}" for o, lr in tuned.items()),
          flush=True)
    return [launch_run("final", opt, tuned[opt], args.steps, args) for opt in OPTIMIZERS]


# ---- the report: tables, JSON, figure ----
def sweep_table(runs: list[dict], lrs) -> str:
    """Held-out loss of each (LR, optimizer) of the sweep, the best of each column starred."""
    best = {o: best_lr(runs, o, lrs) for o in OPTIMIZERS}
    lines = ["| lr | " + " | ".join(f"{NAMES[o]} held-out loss" for o in OPTIMIZERS) + " |",
             "|---:|" + "---:|" * len(OPTIMIZERS)]
    for lr in lrs:
        cells = []
        for o in OPTIMIZERS:
            r = next(r for r in runs if r["optimizer"] == o and r["lr"] == lr)
            cells.append(f"{r['held_out_loss']:.4f}" + (" *" if lr == best[o] else ""))
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def final_table(final: list[dict]) -> str:
    """Optimizer, tuned LR, held-out loss, final training loss, ms/step, and Muon over AdamW."""
    lines = [f"| optimizer | tuned lr | held-out loss | train loss (last {LAST_STEPS} steps) | ms/step (median) "
             "| ms/step (p10) |", "|---|---:|---:|---:|---:|---:|"]
    for r in final:
        lines.append(f"| {NAMES[r['optimizer']]} | {r['lr']:g} | {r['held_out_loss']:.4f} | "
                     f"{r['final_train_loss']:.4f} | {r['ms_per_step']:.0f} | {r['ms_per_step_p10']:.0f} |")
    adamw, muon = (next(r for r in final if r["optimizer"] == o) for o in OPTIMIZERS)
    lines.append(f"| Muon - AdamW, Muon / AdamW | | {muon['held_out_loss'] - adamw['held_out_loss']:+.4f} | "
                 f"{muon['final_train_loss'] - adamw['final_train_loss']:+.4f} | "
                 f"{muon['ms_per_step'] / adamw['ms_per_step']:.2f}x | "
                 f"{muon['ms_per_step_p10'] / adamw['ms_per_step_p10']:.2f}x |")
    return "\n".join(lines)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start): no lag past the last point's window."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_pair(final: list[dict], path: Path, title: str) -> Path:
    """Both final runs' training loss against step on one axes: each step's loss faint, its trailing
    mean over a twentieth of the run solid; the legend names the LR and the held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "optim_compare"})  # text as text, stable ids
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    window = max(1, max(len(r["curve"]) for r in final) // 20)
    smoothed = []
    for r, color in zip(final, ("tab:blue", "tab:orange")):
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        smoothed.append(smooth(list(losses), window))
        ax.plot(steps, smoothed[-1], color=color, linewidth=1.8,
                label=f"{NAMES[r['optimizer']]}, lr {r['lr']:g}: held-out loss {r['held_out_loss']:.3f}")
    tail = [v for s in smoothed for v in s[len(s) // 10:]]  # the warm-up's first losses would flatten the rest
    top = max(max(s[min(len(s) - 1, window)] for s in smoothed), max(tail))
    ax.set_ylim(min(tail) - 0.05 * (top - min(tail)), top + 0.05 * (top - min(tail)))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title=f"trailing mean over {window} steps" if window > 1 else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def settings(args, tuned: dict) -> dict:
    """What was run, where: the command line, the forwarded overrides, the machine, the versions."""
    import torch

    return {"argv": sys.argv[1:], "steps": args.steps, "sweep_steps": args.sweep_steps, "lrs": args.lrs,
            "nproc": args.nproc, "overrides": args.overrides, "tuned_lr": tuned,
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
            "cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "python": platform.python_version()}


def train_all(args) -> dict:
    """The sweep, then the final pair at each optimizer's pick."""
    args.run_root = args.run_root or Path(tempfile.mkdtemp(prefix="optim_compare-"))
    print(f"run directories under {args.run_root}", flush=True)
    swept = sweep(args)
    tuned = {o: best_lr(swept, o, args.lrs) for o in OPTIMIZERS}
    return {"settings": settings(args, tuned), "runs": swept + final_pair(tuned, args)}


def reread(path: Path) -> dict:
    """A ``--json`` report with each run's numbers read again from its run directory (`read_run`)."""
    report = json.loads(path.read_text())
    report["runs"] = [{**r, **read_run(Path(r["run_dir"]))} for r in report["runs"]]
    return report


def write_report(report: dict, args) -> None:
    """Print the tables; write the JSON and the figure where asked."""
    s, runs = report["settings"], report["runs"]
    swept, final = [r for r in runs if r["stage"] == "sweep"], [r for r in runs if r["stage"] == "final"]
    if swept:
        print(f"\nsweep ({s['sweep_steps']} steps; * the LR picked):\n{sweep_table(swept, s['lrs'])}")
    print(f"\nfinal pair ({s['steps']} steps):\n{final_table(final)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nruns: {args.json}")
    failed = [r["run_dir"] for r in runs if r["returncode"] != 0]
    if failed:
        print(f"runs that failed (see their launch.log): {', '.join(failed)}")
    sources = sorted({r.get("source") for r in runs} - {None})
    if len(sources) > 1:
        print(f"the tree changed while the runs went: {len(sources)} versions of the code ({', '.join(sources)})")
    if any(r["returncode"] != 0 or not r["curve"] for r in final):
        raise SystemExit("a run of the final pair failed: no figure")
    if args.figure:
        title = f"AdamW against Muon: {s['steps']} steps, the same data, seed and config"
        print(f"figure: {plot_pair(final, args.figure, title)}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = reread(args.report_from) if args.report_from else train_all(args)
    write_report(report, args)
    return report


if __name__ == "__main__":
    main()
