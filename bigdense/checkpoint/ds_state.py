"""What bigdense's checkpoints read from DeepSpeed's optimizers, which has no public API
(workaround 7 of `bigdense.train.engines.ds_compat`, where every DeepSpeed workaround is listed).

The parameter groups and their flat fp32 partitions of a ZeRO-1/2 or BF16 optimizer sit under
``bit16_groups`` / ``single_partition_of_fp32_groups`` (ZeRO) or ``bf16_groups`` /
``fp32_groups_flat_partition`` (BF16); where a parameter's fragment lies in this DP rank's
partition is its ``_hp_mapping``; the fp16 loss scaler's counters are plain attributes of
``loss_scaler`` (``loss_scale_config`` in the stage-0 optimizer); at stage 0, bf16/fp16 weights get
an optimizer whose ``fp16_groups`` are the module's parameters and ``fp32_groups`` one master each.
"""
from __future__ import annotations

from typing import Optional


_ZERO_LAYOUTS = (("bit16_groups", "single_partition_of_fp32_groups"), ("bf16_groups", "fp32_groups_flat_partition"))
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def zero_layout(optimizer) -> Optional[tuple[list, list]]:
    """``(parameter groups, flat fp32 partitions)`` of a ZeRO-1/2 or BF16 optimizer wrapper, or
    ``None`` for any other optimizer."""
    if not hasattr(optimizer, "optimizer"):
        return None
    for lp, hp in _ZERO_LAYOUTS:
        if hasattr(optimizer, lp) and hasattr(optimizer, hp):
            return getattr(optimizer, lp), getattr(optimizer, hp)
    return None


def zero_fragment(param) -> Optional[tuple[int, int, int]]:
    """``(start in the flattened parameter, numel, start in the flat partition)`` of the fragment
    of ``param`` this DP rank holds, or ``None``."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None or mapping.lp_fragment_address.numel == 0:
        return None
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel, mapping.get_hp_fragment_address().start


def unfused_masters(optimizer) -> Optional[tuple[list, list]]:
    """``(low-precision parameter groups, their fp32 master groups)`` of DeepSpeed's stage-0
    bf16/fp16 optimizer (one master tensor per parameter), or ``None`` for any other optimizer
   ."""
    if not (hasattr(optimizer, "optimizer") and hasattr(optimizer, "fp16_groups")):
        return None
    masters = getattr(optimizer, "fp32_groups", None)
    if not isinstance(masters, list) or any(not isinstance(group, list) for group in masters):
        return None  # the fused fp16 optimizer keeps flat masters, not one per parameter
    return optimizer.fp16_groups, masters


def _scaler(optimizer):
    """Where the fp16 loss scale's counters live: ``loss_scaler``, or ``loss_scale_config``."""
    return getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)


def loss_scaler_state(optimizer) -> Optional[dict]:
    """The fp16 loss scaler's scale and counters, or ``None`` without one."""
    scaler = _scaler(optimizer)
    return None if scaler is None else {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}


def load_loss_scaler_state(optimizer, state: Optional[dict]) -> None:
    """Set the fp16 loss scaler's scale and counters from `loss_scaler_state`'s dict."""
    scaler = _scaler(optimizer)
    for k, v in (state or {}).items():
        if scaler is not None and hasattr(scaler, k):
            setattr(scaler, k, v)
