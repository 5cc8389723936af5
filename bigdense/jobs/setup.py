"""Starting a run, for both launchers: the config checked on every rank (`check_config`, also
before Hydra makes the run directory: `bigdense.jobs.run`), the mesh built from the `ParallelDims`
that check resolved, every generator seeded, the run directory agreed on (and a named one without
a checkpoint said to start fresh, `note_fresh_run_dir`), the structure of a starting checkpoint
adopted; and a message that ends a launch reported once, last (`stop`, `tell_launcher`,
`HeldStderr`)."""
from __future__ import annotations

import io
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.format import LATEST, RUN_CHECKPOINTS, read_manifest, resolve_checkpoint
from ..checkpoint.hf_files import RUN_HF
from ..config import validate
from ..models.hf_dir import HFDirectory
from ..parallel.context import ParallelContext, ParallelDims, init_parallel
from ..train.faults import require_writable
from ..train.precision import warn_if_cpu_emulates

log = logging.getLogger("bigdense")


@dataclass
class Run:
    ctx: ParallelContext
    run_dir: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / RUN_CHECKPOINTS

    @property
    def hf_dir(self) -> Path:
        """Where a fine-tune keeps its Hugging Face config and tokenizer files, for `bigdense.export_hf`."""
        return self.run_dir / RUN_HF

    @property
    def layout(self) -> dict:
        """``{"tp": ..., "dp": ...}`` of this launch: recorded in metrics.jsonl at each launch, so the
        loss curve names every layout the run has had."""
        return {"tp": self.ctx.tp_size, "dp": self.ctx.dp_size}

    def label(self, cfg) -> str:
        """The run's name and model, for a plot's title (which adds the layouts, from the metrics):
        ``"gpt-a: gpt d=256 x 4 layers, fp32, ddp"`` (model=hf: ``"llama from DIR"``)."""
        m = cfg.model
        model = (f"{HFDirectory.open(m.path).config['model_type']} from {m.path}" if m.name == "hf" else
                 f"{m.name} d={m.d_model} x {m.n_layers} layers")
        return f"{self.run_dir.name}: {model}, {cfg.precision.dtype}, {cfg.engine.kind}"

    def describe_outputs(self, files, tensorboard_dir=None) -> str:
        """What the run directory holds at the end: ``files`` written, the checkpoints (how many,
        how big: a short run's final one alone holds the model and its AdamW state), TensorBoard's
        event files."""
        saved = sorted(p for p in self.checkpoint_dir.glob("step_*") if p.is_dir())
        size = sum(f.stat().st_size for p in saved for f in p.rglob("*") if f.is_file())
        lines = [f"run directory {self.run_dir}:", "  " + ", ".join(Path(f).name for f in files if f),
                 f"  {RUN_CHECKPOINTS}/: {len(saved)} checkpoint(s), {size / 1e6:,.0f} MB "
                 f"(trainer.keep_last=N keeps the newest N; trainer.save_interval=0 saves only the last)"]
        if tensorboard_dir is not None:
            lines.append(f"  {tensorboard_dir.name}/: .venv/bin/tensorboard --logdir {tensorboard_dir}")
        return "\n".join(lines)


def launcher_world() -> tuple[int, int]:
    """(rank, world size) as the launcher set them, before any process group exists."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def stop(message: str, code: int):
    """Print a message that every rank meets alike (a bad config, a checkpoint that cannot be
    loaded) once, then exit with ``code``.

    Rank 0 prints at once, to the console itself: under torchrun its line comes before torchrun's
    own report of the failure (a stack trace, then the peers it stopped), so it is among the first
    lines on the screen. The other ranks leave it to rank 0: torchrun stops every rank once one
    exits, so they are normally stopped while they wait, silently. One still here after that,
    rank 0 did not meet the error (a check that depends on the machine): it says it. Under
    torchrun the message also goes to its error file (`tell_launcher`), so the failure summary
    ends with it too.
    """
    rank = launcher_world()[0]
    if rank != 0:
        time.sleep(10)
        message = message.replace("bigdense: ", f"bigdense (rank {rank}): ", 1)
    tell_launcher(message)
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def tell_launcher(message: str) -> bool:
    """Leave ``message`` in torchrun's error file for this process (``TORCHELASTIC_ERROR_FILE``);
    whether it could (False outside torchrun).

    torchrun ends a failed launch with a summary whose last entry is the first failure's
    ``traceback``, read from that file; without one the entry only points at torchrun's docs. So the
    message a person can act on is also the last thing on the screen.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    record = {"message": {"message": message,
                          "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        return False
    return True


class HeldStderr:
    """Holds what Hydra writes to stderr until the job starts, so its composition errors go
    through `stop` (printed by rank 0 alone) rather than once per rank."""

    def __init__(self):
        self.real = sys.stderr
        self.held = io.StringIO()

    def __enter__(self):
        sys.stderr = self.held
        return self

    def release(self) -> None:
        """The job started: what was held (warnings) is written out, stderr is stderr again."""
        if sys.stderr is self.held:
            sys.stderr = self.real
            self.real.write(self.held.getvalue())

    def __exit__(self, kind, err, tb) -> None:
        if kind is SystemExit and err.code and sys.stderr is self.held and self.held.getvalue():
            sys.stderr = self.real
            stop(self.held.getvalue().rstrip(), err.code)
        self.release()


def check_config(cfg) -> ParallelDims:
    """`validate` the job config ``cfg`` for this launch (the launcher's world size, CUDA when there
    is a GPU and the backend allows it); the mesh's dimensions. Raises `ConfigError`."""
    _, world = launcher_world()
    use_cuda = torch.cuda.is_available() and cfg.parallel.backend in (None, "nccl")
    return validate(cfg, world, "cuda" if use_cuda else "cpu")


def start_run(cfg, hydra_output_dir: str) -> Run:
    """Check the config, build the mesh, seed every generator, agree on the run directory, make
    sure its checkpoints/ can be written, and take a compressed starting checkpoint's structure.
    Rank 0 says once what a user may not expect: a named run directory without a checkpoint (a
    fresh run), a precision this CPU emulates.

    The config is validated on every rank before the process group exists, so a bad value stops
    all ranks at once with the same message (raised as `ConfigError`). (The launchers checked it
    before Hydra made the run directory too; this check is for every other caller.)
    """
    ctx = init_parallel(dims=check_config(cfg), backend=cfg.parallel.backend, timeout=cfg.parallel.timeout_s)
    # Every rank gets the same seed: TP-invariant initialisation and dropout rely on the ranks of a
    # TP group drawing the same numbers; data order comes from its own generator.
    seed_everything(cfg.trainer.seed)
    run_dir = [hydra_output_dir]
    if ctx.is_distributed:
        # Ranks may have started in different seconds; rank 0's directory is the run's.
        dist.broadcast_object_list(run_dir, src=0)
    run = Run(ctx, Path(run_dir[0]))
    require_writable(run.checkpoint_dir, ctx)  # made by rank 0; a ConfigError on every rank if it cannot be
    if ctx.is_main:
        note_fresh_run_dir(cfg.trainer)
        warn_if_cpu_emulates(cfg.precision.dtype, ctx.device)
    else:
        quiet_console()
    adopt_compressed_structure(cfg)
    return run


def note_fresh_run_dir(tr) -> None:
    """A named ``trainer.run_dir`` without a checkpoint starts a new run from step 0: say so, and
    name any sibling run directory one edit away that holds a checkpoint (``outputs/gpt-aa`` typed
    for ``outputs/gpt-a`` would otherwise start over without a word)."""
    if not tr.run_dir or not tr.resume:  # a new directory per launch, or the checkpoints ignored on purpose
        return
    named = Path(str(tr.run_dir)).expanduser()
    if (named / RUN_CHECKPOINTS / LATEST).exists():
        return
    siblings = sorted(named.parent.iterdir()) if named.parent.is_dir() else []
    near = [p for p in siblings if p.name != named.name and edit_distance(p.name, named.name) == 1
            and (p / RUN_CHECKPOINTS / LATEST).exists()]
    hint = "".join(f"; {p} (one edit away) holds a run with checkpoints: trainer.run_dir={p} resumes it"
                   for p in near)
    # A warning when the name may be a typo: it is then the line to read before the steps start.
    log.log(logging.WARNING if near else logging.INFO, "trainer.run_dir=%s holds no checkpoint: a new run starts "
            "there from step 0%s", tr.run_dir, hint)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions from ``a`` to ``b``."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def adopt_compressed_structure(cfg) -> None:
    """A run starting from a compressed checkpoint (``trainer.init_from`` written by ``python -m
    bigdense.compress``) takes the structure of its weights where the run names none of its own
    (`compressed_structure`). Set in the run's config before any model is built, so the run's own
    checkpoints record it too. A value given that differs is left as given; loading then names the
    difference."""
    init_from = cfg.trainer.get("init_from")
    if not init_from:
        return
    adopted = compressed_structure(read_manifest(resolve_checkpoint(init_from)).get("config") or {})
    if "model.low_rank" in adopted and not cfg.model.get("low_rank"):
        cfg.model.low_rank = adopted["model.low_rank"]
        log.info("model.low_rank from trainer.init_from=%s (written by bigdense.compress): %s", init_from,
                 adopted["model.low_rank"])
    if "model.d_hidden" in adopted and cfg.model.get("d_hidden") is None:
        cfg.model.d_hidden = adopted["model.d_hidden"]
        log.info("model.d_hidden=%d from trainer.init_from=%s (its MLPs pruned by bigdense.compress)",
                 cfg.model.d_hidden, init_from)


def compressed_structure(saved: dict) -> dict:
    """``{config key: value}`` of the structure a checkpoint's recorded config ``saved`` gives a run
    started from it (`adopt_compressed_structure`): ``model.low_rank`` (low-rank pairs, of ranks
    chosen from the weights) and, when its MLPs were pruned by hidden units (``--structure rows``),
    ``model.d_hidden``."""
    model = saved.get("model") or {}
    structure = {}
    if model.get("low_rank"):
        structure["model.low_rank"] = dict(model["low_rank"])
    if (saved.get("compressed") or {}).get("rows"):
        structure["model.d_hidden"] = int(model["d_hidden"])
    return structure


def quiet_console() -> None:
    """On ranks other than 0: what every rank logs alike (a resume, a changed schedule, skipped
    steps) is shown once, by rank 0; this rank's console shows its errors only, and its own log
    file (``train_rank<N>.log``) keeps everything."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.ERROR)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
