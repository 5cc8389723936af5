"""The random-number generator states a checkpoint restores, so a resumed run draws what an
uninterrupted one would: torch's CPU generator (dropout keys of CPU runs), CUDA's (dropout keys of
GPU runs), python's and numpy's.

CUDA's are kept twice: every visible device's, and this rank's own device's (``cuda_current``),
which a rank restores into its own device whatever the machine's device count, so a run resumed
on another number of GPUs draws the keys the saving rank would have drawn next."""
from __future__ import annotations

import random

import torch


def capture_rng() -> dict:
    """This process's RNG states (torch CPU, CUDA if initialised, python, numpy), weights_only-safe."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_current"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    if "cuda_current" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_current"])
