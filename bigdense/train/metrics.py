"""What a training run reports: JSONL metrics, a console line per log interval, peak memory, the
RMS of every dense layer (weights, activations, gradients), and the loss curve as a PNG.

Only the main rank writes; every rank takes part in the collectives of `DenseLayerStats`.
"""
from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..layers.base import TensorParallelModule
from ..parallel import comm


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (main rank only)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self.enabled:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class DenseLayerStats:
    """RMS of each dense layer's weight, output activation and weight gradient, over the whole
    (unsharded) tensor: sharded pieces contribute their sums of squares, summed over TP.

    Hooks record activations only while ``capture`` is on (one micro-batch per log interval), so
    the cost is paid at log steps only.
    """

    def __init__(self, model: nn.Module, tp_group):
        self.tp_group = tp_group
        self.capture = False
        self._acts: dict[str, tuple[torch.Tensor, int, bool]] = {}
        self._layers = {
            name: m for name, m in model.named_modules()
            if isinstance(m, (TensorParallelModule, nn.Linear, nn.Embedding)) and hasattr(m, "weight")
            and not any(isinstance(c, TensorParallelModule) for c in m.children())
        }
        for name, module in self._layers.items():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def record(module, inputs, output):
            if self.capture and isinstance(output, torch.Tensor):
                out = output.detach().float()
                # Column-style layers hand out a shard of the last dim; Row/embedding outputs are whole.
                sharded = getattr(module, "gather_output", True) is False
                self._acts[name] = (out.square().sum(), out.numel(), sharded)

        return record

    def collect(self) -> dict[str, float]:
        """``{"rms/<layer>/weight|act|grad": value}``; a collective over TP (every rank must call it)."""
        keys, sums, counts = [], [], []

        def add(key, tensor: Optional[torch.Tensor], sharded: bool):
            if tensor is None:
                return
            t = tensor.detach().float()
            keys.append(key)
            # Replicated tensors are counted on TP rank 0 only, so the sum over TP counts them once.
            own = sharded or comm.group_rank(self.tp_group) == 0
            sums.append(t.square().sum() if own else t.new_zeros(()))
            counts.append(float(t.numel()) if own else 0.0)

        for name, module in self._layers.items():
            specs = module.bd_shard_specs() if isinstance(module, TensorParallelModule) else {}
            add(f"rms/{name}/weight", module.weight, "weight" in specs)
            add(f"rms/{name}/grad", module.weight.grad, "weight" in specs)
            if name in self._acts:
                total, numel, sharded = self._acts[name]
                keys.append(f"rms/{name}/act")
                own = sharded or comm.group_rank(self.tp_group) == 0
                sums.append(total if own else total.new_zeros(()))
                counts.append(float(numel) if own else 0.0)
        self._acts.clear()
        if not keys:
            return {}
        stacked = torch.stack([torch.stack(sums).cpu(), torch.tensor(counts)])
        device = next(iter(self._layers.values())).weight.device
        stacked = comm.all_reduce_(stacked.to(device), self.tp_group).cpu()
        return {k: math.sqrt(s / c) if c else 0.0 for k, s, c in zip(keys, stacked[0].tolist(), stacked[1].tolist())}


def plot_loss_curve(metrics_path: Path, png_path: Path) -> Optional[Path]:
    """Train and eval loss against step, from ``metrics.jsonl``; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = [], []
    with open(metrics_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "train":
                train.append((rec["step"], rec["loss"]))
            elif rec.get("kind") == "eval":
                evals.append((rec["step"], rec["eval_loss"]))
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
