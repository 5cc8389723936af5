"""Model FLOPs utilisation (MFU): the model's FLOPs per token against the device's peak.

FLOPs per token of a decoder-only transformer, forward and backward (Kaplan et al. 2020; PaLM,
Chowdhery et al. 2022, appendix B): ``6 N + 12 L d S`` for ``N`` parameters, ``L`` layers, width
``d`` and sequence length ``S``: each weight takes part in one multiply-add per token forward
and two backward, and attention's score and value products add ``12 L d S``. Recomputation is
not counted (that would be hardware FLOPs utilisation): MFU is the useful fraction.

Peaks are dense bf16 tensor-core TFLOP/s per device from the vendors' data sheets (no sparsity);
`peak_tflops` finds one from the device name, or the user sets ``trainer.peak_tflops``.
"""
from __future__ import annotations

from typing import Optional

import torch

# Longest name first: "H100 PCIe" must win over "H100".
PEAK_BF16_TFLOPS = {
    "B200": 2250.0, "GB200": 2500.0, "H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
    "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0,
    "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "MI300X": 1307.0, "MI250X": 383.0,
}


def peak_tflops(device, override: Optional[float] = None) -> Optional[float]:
    """The device's peak dense bf16 TFLOP/s: ``override`` if given, else from the table by the
    CUDA device's name; None when unknown (CPU, an unlisted GPU): MFU is then not reported."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L d S``."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_s_per_device: float, flops_token: float, peak: Optional[float]) -> Optional[float]:
    """Achieved model FLOP/s per device over the peak (0..1), or None without a peak."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s_per_device * flops_token / (peak * 1e12)
