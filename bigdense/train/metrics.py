"""What a training run records: JSONL metrics (and the same scalars as TensorBoard event files),
peak memory, the RMS of every dense layer (weights, activations, gradients), each launch's layout,
and the loss curve as a PNG, titled with every layout the run has had. (The console line and the
progress bar are `launch/train.py`'s; the dense layers' histograms are
`bigdense.train.histograms`', written here.)

Only the main rank writes; every rank takes part in the collectives of `DenseLayerStats`.
"""
from __future__ import annotations

import json
import math
import os
import resource
import textwrap
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..parallel import comm
from ..parallel.sharding import is_dtensor, shard_spec_of


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (main rank only); with
    ``tensorboard=True`` also writes every numeric field as a TensorBoard scalar, tagged
    ``<kind>/<field>`` at the record's ``step``, to event files in ``<run_dir>/tensorboard``
    (and `write_histograms` the dense layers' histograms there)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard_dir = Path(run_dir) / "tensorboard" if tensorboard else None
        self._file = open(self.path, "a", buffering=1) if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        if self._tb is not None and "step" in record:
            kind = record.get("kind", "train")
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, record["step"])
            self._tb.flush()

    def write_launch(self, step: int, layout: dict) -> None:
        """The record of a launch that trains from ``step``: kind ``start`` (step 0) or ``resume``,
        with its ``layout`` (``{"tp": 2, "dp": 1}``), from which the loss curve's title names each
        layout of the run and the steps it trained."""
        self.write({"kind": "resume" if step > 0 else "start", "step": step, "layout": dict(layout)})

    def write_histograms(self, histograms: dict, step: int) -> None:
        """Each `bigdense.train.histograms.Histogram` as a TensorBoard histogram tagged by its key, at
        ``step``; nothing without TensorBoard (histograms have no JSONL form)."""
        if self._tb is None:
            return
        for tag, h in histograms.items():
            self._tb.add_histogram_raw(tag, min=h.min, max=h.max, num=h.num, sum=h.sum, sum_squares=h.sum_squares,
                                       bucket_limits=h.bucket_limits, bucket_counts=h.bucket_counts,
                                       global_step=step)
        self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _is_dense(module: nn.Module) -> bool:
    # A sharded BatchNorm is a TensorParallelModule but no dense layer: per-feature, maybe without a weight.
    return (isinstance(module, (TensorParallelModule, nn.Linear, nn.Embedding))
            and not isinstance(module, nn.modules.batchnorm._NormBase))


def weighted_dense_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the dense layers with a ``weight`` (whose weight and gradient are reported)."""
    return {name: m for name, m in model.named_modules() if _is_dense(m) and hasattr(m, "weight")}


class DenseLayerStats:
    """RMS of each dense layer's weight and weight gradient, and of its input (``act_in``) and
    output (``act``) activations, each over the whole (unsharded) tensor: sharded pieces
    contribute their sums of squares, summed over TP.

    Dense layers are bigdense's layers (but its sharded BatchNorm), ``nn.Linear`` and ``nn.Embedding``. ``ParallelMLP`` has no
    weight of its own but its input is what its ``up``/``gate`` projections see (they run inside
    it, not as modules), so it reports activations. The head reports its input only: its output is
    the loss; its logits are never materialised. Hooks record while ``capture`` is on (the loop
    turns it on for the steps it logs), the last forward of the step winning.
    """

    def __init__(self, model: nn.Module, tp_group):
        self.tp_group = tp_group
        self.capture = False
        self._acts: dict[str, tuple[torch.Tensor, int, bool]] = {}
        self._weighted = weighted_dense_layers(model)
        for name, module in model.named_modules():
            if _is_dense(module):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def record(module, inputs, output):
            if not self.capture:
                return
            x = inputs[0] if inputs else None
            row = isinstance(module, RowParallelLinear)
            # Under sequence parallelism a layer's sequence-side activations are this rank's share.
            sp = getattr(module, "sequence_parallel", False)
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                # A row-parallel layer takes this rank's slice of the hidden features.
                sharded = (row and module.input_is_parallel) or (sp and not row)
                self._record(f"{name}/act_in", x, sharded)
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() > 0:
                # Column-parallel layers hand out their slice of the output features.
                column = isinstance(module, ColumnParallelLinear)
                sharded = (column and not module.gather_output) or (sp and not column)
                self._record(f"{name}/act", output, sharded)

        return record

    def _record(self, key: str, t: torch.Tensor, sharded: bool) -> None:
        t = t.detach().float()
        self._acts[key] = (t.square().sum(), t.numel(), sharded)

    def collect(self) -> dict[str, float]:
        """``{"rms/<layer>/weight|grad|act_in|act": value}``; a collective over TP (every rank calls it)."""
        entries: list[tuple[str, torch.Tensor, float, bool]] = []
        for name, module in self._weighted.items():
            sharded = shard_spec_of(module.weight) is not None
            for kind, t in (("weight", module.weight), ("grad", module.weight.grad)):
                if t is not None:
                    t = t.detach().float()
                    # An FSDP-sharded tensor's sum over its DP slices: one scalar all-reduce, no gather.
                    total = t.square().sum().full_tensor() if is_dtensor(t) else t.square().sum()
                    entries.append((f"{name}/{kind}", total, float(t.numel()), sharded))
        entries += [(key, total, float(numel), sharded) for key, (total, numel, sharded) in self._acts.items()]
        self._acts.clear()
        if not entries:
            return {}
        # Replicated tensors count on TP rank 0 only, so the sum over TP counts them once.
        own = [sharded or comm.group_rank(self.tp_group) == 0 for _, _, _, sharded in entries]
        sums = torch.stack([total if o else total.new_zeros(()) for (_, total, _, _), o in zip(entries, own)])
        counts = torch.tensor([numel if o else 0.0 for (_, _, numel, _), o in zip(entries, own)], device=sums.device)
        totals = comm.all_reduce_(torch.stack([sums, counts]), self.tp_group).cpu()
        return {f"rms/{key}": math.sqrt(s / c) if c else 0.0
                for (key, *_), s, c in zip(entries, totals[0].tolist(), totals[1].tolist())}


LAUNCH_KINDS = ("start", "resume")  # the records `MetricsLog.write_launch` writes
TITLE_SIZES = (12, 11, 10, 9, 8)  # points: matplotlib's "large" down to what still reads at 110 dpi


def layout_history(records: list[dict]) -> str:
    """Every layout a run has had, from its launch records and its last step: ``"tp=2 x dp=1"``
    when there was one, else ``"tp=2 x dp=1 (steps 0-40), tp=1 x dp=2 (steps 40-80)"``. Steps a
    metrics file has no launch record for (written before launches recorded their layout) are
    ``"layout not recorded"``; a file with none at all gives ``""``."""
    launches = [r for r in records if r.get("kind") in LAUNCH_KINDS]
    if not launches:
        return ""
    spans: list[list] = [] if launches[0]["step"] == 0 else [["layout not recorded", 0]]  # [layout, first step]
    for r in launches:
        layout = r.get("layout")
        label = f"tp={layout['tp']} x dp={layout['dp']}" if layout else "layout not recorded"
        if spans and spans[-1][1] == r["step"]:  # relaunched before training a step: the later layout trains
            spans.pop()
        if not spans or spans[-1][0] != label:
            spans.append([label, r["step"]])
    if len(spans) == 1:
        return spans[0][0]
    last = max(r["step"] for r in records if "step" in r)
    ends = [first for _, first in spans[1:]] + [last]
    return ", ".join(f"{label} (steps {first}-{end})" for (label, first), end in zip(spans, ends))


def fit_title(fig, lines: list[str]):
    """``lines`` as the figure's title (``suptitle``), at the largest of `TITLE_SIZES` at which the
    widest fits the figure's width; at the smallest, lines that still do not fit are wrapped (at
    spaces and hyphens, a long word broken). A run directory's name under torchrun is a 36-character
    id, so the title of a long name, its model and its layouts needs this."""
    renderer = fig.canvas.get_renderer()
    room = 0.96 * fig.bbox.width  # a margin on either side
    for size in TITLE_SIZES:
        title = fig.suptitle("\n".join(lines), fontsize=size)
        width = title.get_window_extent(renderer).width
        if width <= room:
            return title
    chars = int(max(map(len, lines)) * room / width)  # characters that fit in a line, about
    while True:
        title.set_text("\n".join(part for line in lines for part in textwrap.wrap(line, max(chars, 8))))
        if title.get_window_extent(renderer).width <= room or chars <= 8:
            return title
        chars -= 2


def loss_curve_figure(records: list[dict], *, title: str = "", loss_unit: str = "nats/token", accuracy: bool = False):
    """The figure `plot_loss_curve` saves, from ``metrics.jsonl``'s records (None without train records)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    resumes = sorted({r["step"] for r in records if r.get("kind") == "resume"})
    if not train:
        return None
    panels = 2 if accuracy and any("top1" in r for r in evals) else 1
    # Constrained layout keeps room for the title above the panels, whatever its number of lines.
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False, layout="constrained")
    ax = axes[0][0]
    ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
    ax.set_ylabel(f"cross-entropy ({loss_unit})")
    if panels == 2:
        acc = axes[0][1]
        scored = [r for r in evals if "top1" in r]
        for key, label in (("top1", "top-1"), ("top5", "top-5")):
            acc.plot([r["step"] for r in scored], [100 * r[key] for r in scored], "o-", label=f"held-out {label}")
        acc.set_ylabel("accuracy (%)")
    for a in axes[0]:
        for i, step in enumerate(resumes):
            a.axvline(step, color="grey", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend()
    lines = [line for line in (title, layout_history(records)) if line]
    if lines:
        extra = fit_title(fig, lines).get_text().count("\n")
        fig.set_size_inches(7 * panels, 4 + 0.2 * extra)  # the panels keep their height under a longer title
    return fig


def plot_loss_curve(metrics_path: Path, png_path: Path, *, title: str = "", loss_unit: str = "nats/token",
                    accuracy: bool = False) -> Optional[Path]:
    """Train and held-out loss against step, from ``metrics.jsonl``; returns the PNG's path.

    ``title`` names the run (two runs' curves side by side can be told apart); the title adds
    every layout the run has had (`layout_history`), and fits the figure's width (`fit_title`).
    ``loss_unit`` is what the cross-entropy is averaged over; ``accuracy`` adds a panel of held-out
    top-1/top-5 accuracy (records with ``top1``/``top5``). A dashed line marks each step the run
    resumed from (records of kind ``resume``).
    """
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    fig = loss_curve_figure(records, title=title, loss_unit=loss_unit, accuracy=accuracy)
    if fig is None:
        return None
    import matplotlib.pyplot as plt  # after `loss_curve_figure` chose the Agg backend

    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path


class StepWindow:
    """A log interval's step results (`StepResult.raw`), kept on the device until a sync point reads
    them: one host read per interval instead of one per step."""

    def __init__(self):
        self.start, self.steps, self.last = time.perf_counter(), 0, None
        self.loss_sum = self.applied = self.skipped = 0.0
        self.tokens = self.correct = self.z_loss_sum = 0.0  # counted targets; of them right; z-loss
        self.pending: list = []  # (step, data position, skipped flag) not yet shown to BadSteps

    def add(self, result, step: int, pos: int) -> None:
        raw = {k: torch.as_tensor(v).float() for k, v in result.raw.items()}
        skipped = raw["skipped"]
        self.loss_sum = self.loss_sum + raw["loss"] * (1 - skipped)
        self.applied, self.skipped = self.applied + (1 - skipped), self.skipped + skipped
        self.tokens = self.tokens + raw["tokens"]
        self.correct = self.correct + raw["accuracy"] * raw["tokens"]
        self.z_loss_sum = self.z_loss_sum + raw["z_loss"] * (1 - skipped)
        self.steps, self.last = self.steps + 1, result
        self.pending.append((step, pos, skipped))

    def replay(self, bad_steps) -> bool:
        """Show the pending steps' outcomes to ``bad_steps`` in order (one host read); True when
        it asks for a rollback (the steps after that one are undone by it anyway)."""
        flags = torch.stack([flag for _, _, flag in self.pending]).tolist() if self.pending else []
        pending, self.pending = self.pending, []
        return any(bad_steps.record(step, pos, flag > 0) for (step, pos, _), flag in zip(pending, flags))

    def read(self) -> dict:
        """The interval's mean loss over its applied steps (one step's loss is too noisy to
        read), its counted target tokens (``target_tokens``), token accuracy and mean z-loss (nan
        where the model has no fused loss), and the last step's numbers, as Python values."""
        applied, last, tokens = float(self.applied), self.last, float(self.tokens)
        return {
            "loss": float(self.loss_sum) / applied if applied else float("nan"), "last_loss": last.loss,
            "grad_norm": last.grad_norm, "lr": last.lr, "skipped": last.skipped,
            "skipped_steps": int(float(self.skipped)), "loss_scale": last.loss_scale,
            "target_tokens": int(tokens) if math.isfinite(tokens) else tokens,
            "accuracy": float(self.correct) / tokens if tokens else float("nan"),
            "z_loss": float(self.z_loss_sum) / applied if applied else float("nan"),
        }
