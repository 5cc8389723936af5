"""How `bigdense.bench.gpu` measures one training step function, the same way for every contender.

`measure` runs ``step()`` (one optimizer step; returns its loss as a tensor):

1. ``warmup`` untimed steps (compilation, CUDA-graph recording), inside `GraphCounts` when the
   step is compiled: the graphs Dynamo compiled, AOTAutograd's backward graphs and the graph
   breaks. AOTAutograd's cache is off there, so a graph already compiled by an earlier case or
   run still passes through the counted compilers (inductor's FX-graph cache still spares the
   code generation);
2. ``steps`` timed steps back to back, as a training loop runs them (nothing synchronises between
   steps): CUDA events around the loop on a GPU, ``perf_counter`` on a CPU; peak memory over them;
3. ``busy_steps`` more under ``torch.profiler`` (CPU and CUDA activities): ``gpu_busy`` is the time
   the device was doing something -- the union of the intervals of its kernels, copies and
   memsets, so work overlapping on several streams counts once -- over the wall time of those
   steps (``perf_counter`` between two synchronisations); ``gpu_kernel_ms`` is that busy time per
   step. Recording every op slows the host, so for a step whose GPU waits on the host
   ``gpu_busy`` is a lower bound; ``gpu_kernel_ms / step_ms`` is the estimate without the
   profiler. On a CPU there is no device activity: both are None.

Graphs compiled during 2 and 3 are reported as ``recompiled_later`` (0 unless a guard failed:
the timing then includes compilation).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Optional

import torch

DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's names of work on the device


def measure(step: Callable[[], torch.Tensor], *, warmup: int, steps: int, busy_steps: int, device: torch.device,
            count_graphs: bool) -> dict:
    """Warm up, time, profile ``step`` (see the module docstring); returns the row's measured fields:
    ``step_s``, ``peak_mem_gb``, ``loss`` (the last timed step's), ``gpu_busy``, ``gpu_kernel_ms``,
    ``warmup``, ``steps`` and, with ``count_graphs``, ``graphs_forward``, ``graphs_backward``,
    ``graph_breaks`` and ``recompiled_later``."""
    from bigdense.train.compile import GraphCounts

    with GraphCounts() as counts, _aot_cache_off():
        for _ in range(warmup):
            step()
    with GraphCounts() as later:
        step_s, peak_gb, loss = time_steps(step, steps, device)
        try:
            busy = busy_fraction(step, busy_steps, device)
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not cost the timings
            busy = dict(gpu_busy=None, gpu_kernel_ms=None, gpu_busy_error=f"{type(exc).__name__}: {exc}")
    out = dict(step_s=step_s, peak_mem_gb=peak_gb, loss=float(loss), warmup=warmup, steps=steps, **busy)
    if count_graphs:
        counted = counts.as_dict()
        out.update({k: counted[k] for k in ("graphs_forward", "graphs_backward", "graph_breaks")},
                   recompiled_later=later.graphs_forward)
    return out


@contextlib.contextmanager
def _aot_cache_off():
    # A graph loaded from AOTAutograd's cache skips the compilers that `GraphCounts` counts.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], torch.Tensor], steps: int,
               device: torch.device) -> tuple[float, Optional[float], torch.Tensor]:
    """(seconds per step, peak GiB -- None on a CPU --, the last step's loss) over ``steps`` steps
    run back to back."""
    synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        return (time.perf_counter() - start) / steps, None, loss
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        loss = step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / steps, torch.cuda.max_memory_allocated(device) / 2**30, loss


def busy_fraction(step: Callable[[], torch.Tensor], steps: int, device: torch.device) -> dict:
    """``gpu_busy`` (0..1) and ``gpu_kernel_ms`` (device-busy ms per step) of ``steps`` steps run
    under the profiler; both None without device activity (a CPU, ``steps`` 0, or a profiler
    that recorded none)."""
    from torch.profiler import ProfilerActivity, profile

    none = dict(gpu_busy=None, gpu_kernel_ms=None)
    if steps <= 0:
        return none
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and ProfilerActivity.CUDA in torch.profiler.supported_activities():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_ns = (time.perf_counter() - start) * 1e9
    busy_ns = union_length(device_intervals(prof.profiler.kineto_results.events()))
    if busy_ns == 0:
        return none
    return dict(gpu_busy=min(1.0, busy_ns / wall_ns), gpu_kernel_ms=busy_ns / 1e6 / steps)


def device_intervals(events: Iterable) -> list[tuple[int, int]]:
    """(start, end) in ns of the profiler's device activities (`DEVICE_ACTIVITIES`). The GPU's own
    user annotations are left out: they span whole regions, idle gaps included."""
    return [(e.start_ns(), e.end_ns()) for e in events
            if e.device_type() != torch.autograd.DeviceType.CPU and e.activity_type() in DEVICE_ACTIVITIES]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end), each point counted once however many
    intervals cover it (kernels overlapping on several streams)."""
    total, reach = 0, None  # reach: the end of the covered stretch so far
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def warm_profiler(device: torch.device) -> Optional[str]:
    """Start and stop the profiler once, before any step is recorded as a CUDA graph: CUPTI
    attaching for the first time after a graph was captured can lose or break that graph's
    kernels (``torch.profiler._utils._init_for_cuda_graphs`` does the same). Returns why it
    failed, or None."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            pass
    except Exception as exc:  # noqa: BLE001 - the busy fraction is optional; the timings are not
        return f"{type(exc).__name__}: {exc}"
    return None
