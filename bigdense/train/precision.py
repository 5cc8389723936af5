"""Mixed precision from ``PrecisionConfig`` for the DDP engine and plain loops: autocast for
compute, fp32 everywhere else; and the ``precision`` group's rules (`check_precision`).

``precision.dtype`` picks the compute dtype of matmuls inside `torch.autocast`. Parameters,
gradients, optimizer state and hence the master weights stay fp32: this module never casts a model
with ``.half()``/``.bfloat16()``, so an optimizer step never rounds a weight update away. (The
DeepSpeed engine is the exception: it uses DeepSpeed's own bf16/fp16, which casts the module's
weights and keeps fp32 masters inside DeepSpeed's optimizer; see `train.engines.deepspeed`.)

fp16's narrow range needs loss scaling. `DynamicLossScaler` is bigdense's scaler, not torch's
``GradScaler``: ``GradScaler`` looks for inf/nan in *this process's* gradients only. Under tensor
parallelism each rank holds different gradient shards, so an overflow in one rank's shard makes
that rank skip its step while the others apply theirs, and from then on the shards of one weight
matrix belong to different models (and their scales drift apart). Here the found-inf flag is
all-reduced (MAX) over a group that spans every rank taking part in the step (TP and DP), so all
ranks skip together and lower the scale together. The scale and its growth counter live on the
device and are updated there (``torch._amp_update_scale_``), unscaling is one foreach kernel that
also finds infs/nans (``torch._amp_foreach_non_finite_check_and_unscale_``): the engines' step
reads nothing back to the host.

On a CPU without native bf16 (fp16) matrix multiplies torch emulates them, and mixed precision is
slower than fp32, not faster: `warn_if_cpu_emulates` says so in the run's log.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..parallel import comm
from ..errors import ConfigError, check_choice, check_positive_int
from ..parallel.sharding import local_tensor
from .clip import unique_params

log = logging.getLogger("bigdense")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The CPU instructions torch's bf16/fp16 matrix multiplies (oneDNN) run natively on, as
# `torch.cpu.get_capabilities` names them. Without any of them a matmul in that dtype is emulated.
CPU_MATMUL_INSTRUCTIONS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
# What emulation cost where it was measured (2-core machines), for the warning.
EMULATION_COST = {"bf16": "about 5x as long per step of the main job", "fp16": "a matmul about 100x as long"}


def compute_dtype(name: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> the torch dtype; the error names ``precision.dtype``."""
    return DTYPES[check_choice("precision.dtype", name, DTYPES)]


def check_precision(cfg, device_type: str) -> None:
    """The ``precision`` group's rules: a known dtype the device supports, and a valid fp16 scaler."""
    compute_dtype(str(cfg.dtype))
    DynamicLossScaler.from_config(cfg, None)  # its constructor checks the scaler's settings
    if cfg.dtype == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision=bf16: this GPU has no bf16 support; use precision=fp16")


def cpu_emulates(dtype: str, capabilities=None) -> bool:
    """Whether this CPU lacks native matrix multiplies in ``dtype`` ("bf16" or "fp16"; fp32 never),
    so that torch emulates them: training can then run several times slower than in fp32.
    ``capabilities``: `torch.cpu.get_capabilities()` unless given; a torch without it counts as
    emulating (the warning it leads to is then a caution)."""
    needed = CPU_MATMUL_INSTRUCTIONS.get(dtype)
    if needed is None:
        return False
    if capabilities is None:
        get = getattr(torch.cpu, "get_capabilities", None)
        capabilities = get() if get is not None else {}
    return not any(capabilities.get(name) for name in needed)


def warn_if_cpu_emulates(dtype: str, device) -> None:
    """Log a warning when ``precision=dtype`` on a CPU ``device`` runs in emulation (`cpu_emulates`).
    Rank 0 calls it once per launch: the ranks of one machine share its CPU."""
    if torch.device(device).type != "cpu" or not cpu_emulates(dtype):
        return
    log.warning("precision=%s on a CPU without native %s matrix multiplies (none of %s): torch emulates them, and "
                "training can run several times slower than with precision=fp32 (%s where measured); precision=fp32 "
                "is likely the faster choice here.", dtype, dtype, ", ".join(CPU_MATMUL_INSTRUCTIONS[dtype]),
                EMULATION_COST[dtype])


def autocast(dtype: str, device) -> contextlib.AbstractContextManager:
    """`torch.autocast` for ``device``'s type in the compute dtype; a no-op context for fp32."""
    torch_dtype = compute_dtype(dtype)
    device_type = torch.device(device).type
    if torch_dtype is torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch_dtype)


def any_rank(flag: bool, group: Optional[dist.ProcessGroup], device="cpu") -> bool:
    """True on every rank of ``group`` when ``flag`` is true on at least one (all-reduce MAX).

    ``group=None`` means one rank: no collective.
    """
    if comm.group_size(group) == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(comm.all_reduce_(t, group, op=dist.ReduceOp.MAX).item() > 0)


class DynamicLossScaler:
    """fp16 dynamic loss scaling whose skip decision is the same on every rank.

    ``scale(loss)`` multiplies the loss by the current scale before ``backward``;
    ``unscale_(params)`` divides the gradients by it and returns whether any rank found an inf/nan
    (one all-reduce MAX of a 1-element flag over ``group``); ``update(found_inf)`` then halves the
    scale (never below ``min_scale``) after an overflow, or doubles it after ``growth_interval``
    overflow-free steps in a row. The caller skips the optimizer step when ``found_inf``.

    ``group`` must span every rank that applies the same optimizer step: the whole TP x DP mesh
    (the engines pass the world group when distributed). ``None`` means a single process.
    ``device``: where the scale lives (the gradients' device). Engines use the sync-free pair
    `unscale_and_check_` (a local found-inf tensor; they take one vote for the whole step) and
    ``update(tensor)``; ``get_scale()``/``scale_value``/``growth_tracker`` read the device values.
    ``state_dict()``/``load_state_dict()`` carry the scale and the growth counter through
    checkpoints, so a resumed run scales exactly as the uninterrupted one.
    """

    def __init__(
        self,
        init_scale: float = 65536.0,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        group: Optional[dist.ProcessGroup] = None,
        device="cpu",
    ):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ConfigError(f"precision.init_scale must be a positive finite number, got {init_scale!r}")
        check_positive_int("precision.growth_interval", growth_interval, ConfigError)
        if not (0 < min_scale <= init_scale):
            raise ConfigError(f"precision.min_scale must be in (0, init_scale={init_scale}], got {min_scale!r}")
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
            raise ValueError(
                f"DynamicLossScaler: growth_factor must be > 1 and backoff_factor in (0, 1), "
                f"got {growth_factor} and {backoff_factor}"
            )
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.group = group
        self.device = torch.device(device)
        self.scale_tensor = torch.full((), float(init_scale), dtype=torch.float32, device=self.device)
        # overflow-free steps since the last change of scale
        self._tracker = torch.zeros((), dtype=torch.int32, device=self.device)

    @property
    def scale_value(self) -> float:
        return float(self.scale_tensor.item())

    @property
    def growth_tracker(self) -> int:
        return int(self._tracker.item())

    @classmethod
    def from_config(cls, cfg, group: Optional[dist.ProcessGroup], device="cpu") -> "DynamicLossScaler":
        """From a ``PrecisionConfig`` (``init_scale``, ``growth_interval``, ``min_scale``)."""
        return cls(float(cfg.init_scale), growth_interval=int(cfg.growth_interval),
                   min_scale=float(cfg.min_scale), group=group, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor.to(loss.device)

    def unscale_and_check_(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide every gradient by the scale in place (in the gradients' dtype: fp32 master
        gradients); return this rank's found-inf flag, a 0-dim float tensor (1.0: an inf/nan).
        No collective and no host sync: the caller takes the vote."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        inv_scale = self.scale_tensor.double().reciprocal().float()
        by_device: dict = {}
        for p in unique_params(params):
            if p.grad is not None:
                by_device.setdefault((p.grad.device, p.grad.dtype), []).append(local_tensor(p.grad))
        for (device, _), grads in by_device.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
            found_inf = torch.maximum(found_inf, flag.to(self.device))
        return found_inf

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """`unscale_and_check_`, then the vote: True on every rank of ``group`` if any rank saw an
        inf/nan (one all-reduce MAX; reads the result on the host)."""
        local = self.unscale_and_check_(params)
        return bool(comm.all_reduce_(local, self.group, op=dist.ReduceOp.MAX).item() > 0)

    def update(self, found_inf) -> None:
        """Lower the scale after an overflow; raise it after ``growth_interval`` clean steps.
        ``found_inf``: a bool, or a 0-dim tensor (then nothing is read on the host)."""
        flag = torch.as_tensor(found_inf, dtype=torch.float32).to(self.device)
        torch._amp_update_scale_(self.scale_tensor, self._tracker, flag, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.scale_tensor.clamp_(min=self.min_scale)

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value, "growth_tracker": self.growth_tracker, "init_scale": self.init_scale,
            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval, "min_scale": self.min_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise KeyError(f"DynamicLossScaler.load_state_dict: missing {sorted(missing)} in {sorted(state)}")
        self.scale_tensor.fill_(float(state["scale"]))
        self._tracker.fill_(int(state["growth_tracker"]))
        # The schedule's knobs come from the current config; the checkpoint's are kept only as a record.


class Precision:
    """What ``precision.dtype`` means on one device: the autocast context and, for fp16, the scaler.

    ``scaler`` is ``None`` for fp32 and bf16 (bf16 has fp32's exponent range: nothing to scale).
    """

    def __init__(self, cfg, device, group: Optional[dist.ProcessGroup] = None):
        self.name = str(cfg.dtype)
        self.dtype = compute_dtype(self.name)
        self.device = torch.device(device)
        self.scaler = DynamicLossScaler.from_config(cfg, group, self.device) if self.name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.name, self.device)

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def __repr__(self) -> str:
        return f"Precision({self.name}, device={self.device.type}, scaler={self.scaler is not None})"
