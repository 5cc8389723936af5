"""Measured memory, to hold the planner's predictions against.

On CUDA the allocator keeps the statistic (``torch.cuda.max_memory_allocated``). On CPU nothing
does (the resident set size includes the interpreter, torch's libraries and freed pages malloc
kept), so `LiveTensorBytes` counts it: a ``TorchDispatchMode`` that sees every tensor an operator
returns -- forward, autograd's backward, the optimizer -- and adds its storage's size until the
storage is freed (a weak-reference finalizer). Storages alive before the mode starts are
registered with ``track``. The result is the peak of bytes held by live tensors, the quantity
``max_memory_allocated`` reports on a GPU (less the caching allocator's rounding).

Two things FSDP2 (``engine=fsdp``) does are followed too: its parameters, gradients and optimizer
state are DTensors, whose local tensors hold the bytes (tensor subclasses are counted by their
inner tensors); and it frees and re-allocates the gathered parameters by resizing their storages in
place (``free_storage``/``alloc_storage`` of ``torch.distributed.fsdp``), which no operator sees:
while a `LiveTensorBytes` is active those two functions report to it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
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
            for plain in _plain_tensors(t):
                self._add(plain.untyped_storage(), op)

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

    def _drop(self, storage) -> None:
        """Stop counting ``storage`` (about to be resized in place)."""
        finalizer = self._live.get(storage.data_ptr())
        if finalizer is not None:
            finalizer()  # subtracts its size and forgets it; a called finalizer never runs again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            for plain in _plain_tensors(t):
                self._add(plain.untyped_storage(), str(func))
        return out

    def __enter__(self):
        self._resizes = _fsdp_storage_resizes(self)
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)


def _plain_tensors(t) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: ``t`` itself, or a subclass's (a DTensor's local) inner tensors."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


@contextlib.contextmanager
def _fsdp_storage_resizes(live: LiveTensorBytes):
    """Report FSDP2's in-place storage resizes (its gathered parameters) to ``live`` while inside."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # no FSDP2 in this torch
        yield
        return
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        live._drop(tensor.untyped_storage())
        alloc(tensor)
        live._add(tensor.untyped_storage(), "fsdp.alloc_storage")

    def free_storage(tensor):
        live._drop(tensor.untyped_storage())
        free(tensor)

    patched = [(_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched if hasattr(module, name)]
    for module, name, fn in patched:
        if hasattr(module, name):
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


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


def measure_config(cfg, repeats: Optional[int] = None) -> dict:
    """Run training steps of the model ``cfg`` (the training config) describes, on this process's
    rank of ``parallel.tp`` x ``parallel.dp``, with random tokens, and measure the steady state
    (optimizer state exists): the least peak of ``repeats`` steps after a first (default: 3 with
    several ranks, 1 alone). Returns `measure_step_peak`'s dict.

    Why the least: gloo's worker threads drop their references to a collective's buffers when they
    are next scheduled; on a loaded machine that can come after the main thread's peak, and the
    step then reads high (by whole activation-sized buffers, never low). The least of a few steps
    is the step as the code runs it. A single process has no collectives, so one step is exact.

    The model is the job's own: the reference GPT (`build_gpt`), or for ``model=hf`` the Hugging
    Face model of ``model.path`` (`build_hf`, converted by its own plan in `parallelize_model`)
    with random weights instead of the directory's, drawn before the conversion so that its loss
    path is decided (and proved) on them: memory does not depend on the values, and the directory
    needs only its config.json."""
    from .. import init_parallel
    from ..jobs import parallelize_model
    from ..layers.base import allocate_empty

    ctx = init_parallel(tp=int(cfg.parallel.tp or 1), dp=cfg.parallel.dp)
    repeats = repeats or (3 if ctx.world_size > 1 else 1)
    torch.manual_seed(0)
    model, vocab = _build(cfg, ctx)
    if cfg.model.name == "hf":
        # Random weights before `parallelize_model` converts the model and decides its loss path on
        # them, as the job decides it on the loaded ones (uninitialised memory fails the proof).
        _randomize(allocate_empty(model, ctx.device))
    engine = parallelize_model(model, ctx, cfg, load_pretrained=False).engine
    b, s = cfg.data.micro_batch_size, cfg.data.seq_len
    batch = [(torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))) for _ in range(cfg.data.grad_accum)]
    engine.train_step(batch)
    steps = [measure_step_peak(lambda: engine.train_step(batch), model, engine.optimizer, ctx.device)
             for _ in range(repeats)]
    return min(steps, key=lambda m: m["peak_bytes"])


def _build(cfg, ctx) -> tuple[torch.nn.Module, int]:
    """The job's model of ``cfg`` (before `parallelize_model`) and its vocabulary size."""
    from ..jobs import build_gpt, build_hf
    from ..models.hf_dir import HFDirectory

    if cfg.model.name == "hf":
        return build_hf(cfg), HFDirectory.open(cfg.model.path).vocab_size
    return build_gpt(cfg, cfg.data.vocab_size, ctx), cfg.data.vocab_size


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Small random values in every floating-point parameter (allocated empty, never loaded)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.normal_(0.0, 0.02)
