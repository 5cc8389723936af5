"""Measured memory, to hold the planner's predictions against.

On CUDA the allocator keeps the statistic (``torch.cuda.max_memory_allocated``). On CPU nothing
does (the resident set size includes the interpreter, torch's libraries and freed pages malloc
kept), so `LiveTensorBytes` counts it: a ``TorchDispatchMode`` that sees every tensor an operator
returns -- forward, autograd's backward, the optimizer -- and adds its storage's size until the
storage is freed (a weak-reference finalizer). Storages alive before the mode starts are
registered with ``track``. The result is the peak of bytes held by live tensors, the quantity
``max_memory_allocated`` reports on a GPU (less the caching allocator's rounding).
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as live: ...`` then ``live.peak`` / ``live.current`` (bytes), and
    ``live.peak_op``, the operator that allocated the tensor which set the peak."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, weakref.finalize] = {}
        self.current = 0
        self.peak = 0
        self.peak_op = ""

    def track(self, tensors: Iterable[torch.Tensor], op: str = "existing") -> None:
        """Count the storages of tensors that already exist (parameters, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), op)

    def _add(self, storage, op: str) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self.current += size
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, op

        def freed(key=key, size=size):
            self._live.pop(key, None)
            self.current -= size

        self._live[key] = weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), str(func))
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def train_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything a training step finds alive: parameters, buffers, gradients, optimizer state."""
    out = [p for p in model.parameters()] + [b for b in model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    return out + optimizer_tensors(optimizer)


def measure_step_peak(step, model, optimizer, device) -> dict:
    """Peak bytes of live tensors during ``step()``, counting what is alive when it starts.

    Returns ``{"peak_bytes", "start_bytes", "peak_op"}``. CUDA: the allocator's own statistics.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return {"peak_bytes": torch.cuda.max_memory_allocated(device), "start_bytes": start, "peak_op": ""}
    with LiveTensorBytes() as live:
        live.track(train_state_tensors(model, optimizer))
        start = live.current
        step()
    return {"peak_bytes": live.peak, "start_bytes": start, "peak_op": live.peak_op}


def measure_config(cfg) -> dict:
    """Run two training steps of the reference GPT that ``cfg`` (the training config) describes, on
    this process's rank of ``parallel.tp`` x ``parallel.dp``, with random tokens; measure the second
    (steady state: optimizer state exists). Returns `measure_step_peak`'s dict."""
    from .. import init_parallel
    from ..jobs import build_gpt, parallelize_model

    ctx = init_parallel(tp=int(cfg.parallel.tp or 1), dp=cfg.parallel.dp)
    torch.manual_seed(0)
    model = build_gpt(cfg, cfg.data.vocab_size, ctx)
    engine = parallelize_model(model, ctx, cfg).engine
    b, s, v = cfg.data.micro_batch_size, cfg.data.seq_len, cfg.data.vocab_size
    batch = [(torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))) for _ in range(cfg.data.grad_accum)]
    engine.train_step(batch)
    return measure_step_peak(lambda: engine.train_step(batch), model, engine.optimizer, ctx.device)
