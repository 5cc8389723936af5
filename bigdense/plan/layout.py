"""A layout: how one training step is laid out over devices (what `--suggest` ranks)."""
from __future__ import annotations

from dataclasses import dataclass, replace

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# What a layout sets in the training config: whole groups, and single keys of others.
LAYOUT_GROUPS = ("precision", "engine", "recompute")
LAYOUT_KEYS = ("parallel.tp", "parallel.dp", "parallel.sequence_parallel", "data.micro_batch_size", "data.grad_accum")


@dataclass(frozen=True)
class Layout:
    """TP x DP mesh, precision, engine, recompute and batch split of a training step.

    ``precision``: the compute dtype; with ``engine="ddp"`` it is autocast over fp32 parameters,
    with ``engine="deepspeed"`` and bf16/fp16 the parameters and activations are in that dtype and
    the fp32 masters live in the optimizer; with ``engine="fsdp"`` the fp32 parameters are sharded
    over DP and gathered in that dtype for compute, under autocast (see ``bigdense.train.engines``).
    ``dp_replicate`` (fsdp only): HSDP, sharded over ``dp / dp_replicate`` ranks, replicated over
    ``dp_replicate`` groups of them.
    """

    tp: int = 1
    dp: int = 1
    precision: str = "fp32"
    engine: str = "ddp"
    zero_stage: int = 0  # deepspeed only
    dp_replicate: int = 1  # fsdp only
    reshard_after_forward: bool = True  # fsdp only
    micro_batch_size: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    recompute_every: int = 2
    sequence_parallel: bool = False
    device_type: str = "cuda"

    def __post_init__(self):
        for key in ("tp", "dp", "micro_batch_size", "grad_accum", "recompute_every", "dp_replicate"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan: {key} must be a positive integer, got {value!r}")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"plan: precision={self.precision!r} is not one of {list(PRECISION_BYTES)}")
        if self.dp % self.dp_replicate or (self.dp_replicate > 1 and self.engine != "fsdp"):
            raise ValueError(f"plan: dp_replicate={self.dp_replicate} needs engine='fsdp' and must divide dp={self.dp}")

    @property
    def compute_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def autocast(self) -> bool:
        """Autocast over fp32 parameters: activations in the compute dtype inside matmuls, fp32
        residual stream and norms, compute-width copies of the weights (``engine=ddp``)."""
        return self.engine == "ddp" and self.precision != "fp32"

    @property
    def cuda_autocast(self) -> bool:
        """CUDA autocast under a lower compute dtype (ddp, fsdp): its fp32-policy ops (softmax,
        layer_norm) return fp32 whatever their input (CPU autocast's follow the input)."""
        return self.engine in ("ddp", "fsdp") and self.precision != "fp32" and self.device_type == "cuda"

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element of the module itself (FSDP's: the gathered copy) and of the
        gradients autograd forms for it."""
        return self.compute_bytes if self.engine in ("deepspeed", "fsdp") else 4

    @property
    def dp_shard(self) -> int:
        """Ranks each parameter is split over (fsdp: ``dp / dp_replicate``; 1 for the other engines)."""
        return self.dp // self.dp_replicate if self.engine == "fsdp" else 1

    @property
    def zero(self) -> int:
        return self.zero_stage if self.engine == "deepspeed" else 0

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def config_values(self) -> dict:
        """``{dotted config key: value}`` of the training config this layout sets."""
        out = {"parallel.tp": self.tp, "parallel.dp": self.dp, "precision.dtype": self.precision,
               "engine.kind": self.engine, "engine.zero_stage": self.zero_stage,
               "engine.dp_replicate": self.dp_replicate, "engine.reshard_after_forward": self.reshard_after_forward,
               "recompute.mode": self.recompute,
               "recompute.every": self.recompute_every, "data.micro_batch_size": self.micro_batch_size,
               "data.grad_accum": self.grad_accum}
        if self.sequence_parallel:
            out["parallel.sequence_parallel"] = True
        return out

    @staticmethod
    def sets(override: str) -> bool:
        """Whether the Hydra override ``key=value`` sets what a layout sets (its keys and groups)."""
        key = override.split("=", 1)[0].lstrip("+~")
        return key in LAYOUT_GROUPS or key.split(".")[0] in LAYOUT_GROUPS or key in LAYOUT_KEYS

    def overrides(self) -> list[str]:
        """The Hydra overrides of `launch/train.py` that select this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.dp={self.dp}", f"precision={self.precision}",
               f"engine={self.engine}"]
        if self.engine == "deepspeed":
            out.append(f"engine.zero_stage={self.zero_stage}")
        if self.dp_replicate > 1:
            out.append(f"engine.dp_replicate={self.dp_replicate}")
        if self.engine == "fsdp" and not self.reshard_after_forward:
            out.append("engine.reshard_after_forward=false")
        out.append(f"recompute={self.recompute}")
        if self.recompute == "every_k":
            out.append(f"recompute.every={self.recompute_every}")
        if self.sequence_parallel:
            out.append("parallel.sequence_parallel=true")
        return out + [f"data.micro_batch_size={self.micro_batch_size}", f"data.grad_accum={self.grad_accum}"]
