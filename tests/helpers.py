"""Comparison helpers and paths shared by the tests."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # torchrun, deepspeed, accelerate of the running environment
TRAIN = str(ROOT / "launch" / "train.py")


def assert_close(actual, expected, what, *, rtol, atol):
    """torch.testing.assert_close with the name of the quantity in the message."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)
