"""``trainer.cuda_graphs``: the whole training step replayed as one CUDA graph.

A small model's step is a few thousand short kernels; launched one by one from Python the GPU
waits on the host between them. `StepGraph` records the DDP engine's step once -- forward,
backward, fp16 unscale, clipping, the skip vote, the LR from the device step counter, fused AdamW,
the loss-scale update -- with ``torch.cuda.graph`` and from then on replays it: one launch a step.
That needs what the step already guarantees (no host synchronisation: `bigdense.train.engines.ddp`)
and everything it touches static in address and shape:

* the micro-batches are copied into input buffers recorded at capture; another batch shape is an
  error (`StepGraph.step`);
* AdamW is built with ``capturable=True`` (its step counts on the device) and reads its LR from a
  device tensor the step computes from the applied-step counter; the fp16 scale and its growth
  counter live on the device;
* gradients are the graph's own tensors: ``param.grad`` keeps pointing at them between replays
  (the loop's gradient logging reads them there);
* dropout keys are drawn from the CUDA generator, which CUDA graphs advance on every replay
  (`bigdense.parallel.dropout.draw_dropout_key`), so every step draws new masks and a resumed
  run draws what the uninterrupted one would;
* a parameter, an optimizer state tensor or a scaler tensor that was replaced (a checkpoint
  loaded into the engine: resume or rollback) makes the next step record the graph again.

The loop's checked steps (host checks on: their range checks read the device) run eagerly on the
graph's stream, and so do the first `WARMUP_STEPS` steps with checks off: the warm-up (lazy
initialisation, AdamW's state and, under ``trainer.compile=model``, the compilation of the forward
the recording runs -- the checked steps run the eager forward, `bigdense.train.compile.compile_model`,
so it compiles at the first checks-off step). The checked steps do not count towards the warm-up:
a compilation inside ``torch.cuda.graph`` would be recorded as whatever it launched. Then the step
is recorded and replayed. Combinations that cannot be recorded are refused by `check_cuda_graphs`
with the reason.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import ConfigError
from ..host_checks import checks_enabled, env_flag

KEY = "trainer.cuda_graphs"
WARMUP_STEPS = 3  # eager checks-off steps on the capture stream before recording (see the module docstring)


def check_cuda_graphs(enabled: bool, *, device_type: str, engine: str = "ddp", world_size: int = 1,
                      compile_mode: str = "false", recompute: str = "none", sampled_head: bool = False,
                      pruning: bool = False) -> None:
    """``trainer.cuda_graphs``'s rules; raises `ConfigError` with the reason. The config's
    validation asks with every argument; an engine asks again with what it knows."""
    if not enabled:
        return
    reason = None
    if device_type != "cuda":
        reason = f"CUDA graphs record GPU kernels; this run is on {device_type}"
    elif engine != "ddp":
        reason = (f"engine.kind={engine} runs host-side logic inside each step (DeepSpeed's optimizer step, FSDP's "
                  f"per-module gathers); use engine=ddp")
    elif world_size > 1:
        reason = (f"collectives replayed inside a CUDA graph escape the process group's deadline, which every bigdense "
                  f"collective keeps; this run has {world_size} processes (one GPU only)")
    elif env_flag("BIGDENSE_CHECKS", False):
        reason = "BIGDENSE_CHECKS=1 keeps host-side range checks on, and they read the device every step"
    elif recompute != "none" and compile_mode != "model":
        reason = (f"recompute.mode={recompute} restores the CUDA generator around each recompute, which a graph "
                  f"being recorded forbids; use trainer.compile=model, which traces the recompute into its graphs")
    elif sampled_head:
        reason = "head.sample_rate < 1 scores a class sample whose size changes every step"
    elif pruning:
        reason = "prune.sparsity > 0 adds masks during the run, which a recorded step would not apply"
    if reason is not None:
        raise ConfigError(f"{KEY}=true cannot be used here: {reason}")


class StepGraph:
    """Runs ``step_fn(micro_batches)`` (the engine's step, returning a `StepResult`) eagerly while
    host checks are on and for the first `WARMUP_STEPS` steps with them off, then records it once
    and replays it (see the module docstring). ``fingerprint()``: the addresses of every tensor the
    step reads and writes across steps (parameters, optimizer and scaler state); a change records
    anew."""

    def __init__(self, step_fn: Callable, fingerprint: Callable[[], tuple], device: torch.device):
        self.step_fn, self.fingerprint, self.device = step_fn, fingerprint, device
        self.stream = torch.cuda.Stream(device)
        self.warm_steps = 0  # eager steps with host checks off: what warms up the recorded step
        self.graph = None
        self.recorded = 0  # times the step was recorded (1 in a run without checkpoint loads)

    def step(self, micro_batches: Sequence[tuple]):
        if checks_enabled():  # a checked step: another forward than the one recorded (`compile_model`)
            return self._on_stream(lambda: self.step_fn(micro_batches))
        if self.warm_steps < WARMUP_STEPS:
            self.warm_steps += 1
            return self._on_stream(lambda: self.step_fn(micro_batches))
        if self.graph is not None:
            self._check_shapes(micro_batches)
        if self.graph is None or self.fingerprint() != self._fingerprint:
            self._record(micro_batches)
        for (x, y), (sx, sy) in zip(micro_batches, self.inputs):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        self.graph.replay()
        return self._result_type(*(t.clone() for t in self.outputs))

    def _on_stream(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out

    def _record(self, micro_batches) -> None:
        self.inputs = [(x.clone(), y.clone()) for x, y in micro_batches]
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(self.graph, stream=self.stream):
            result = self.step_fn(self.inputs)
        self._result_type = type(result)
        self.outputs = [result.raw[k] for k in result.FIELDS]
        self._fingerprint = self.fingerprint()
        self.recorded += 1

    def _check_shapes(self, micro_batches) -> None:
        got = [(tuple(x.shape), x.dtype, tuple(y.shape), y.dtype) for x, y in micro_batches]
        recorded = [(tuple(x.shape), x.dtype, tuple(y.shape), y.dtype) for x, y in self.inputs]
        if got != recorded:
            raise ValueError(f"{KEY}=true: the step was recorded for micro-batches {recorded} (shape, dtype of x and y), "
                             f"got {got}; a recorded step needs one batch shape for the whole run")
