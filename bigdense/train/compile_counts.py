"""What ``torch.compile`` made of a model: graphs, breaks and the work inside the graphs.

`backend_for` gives `bigdense.train.compile` its backends -- inductor's and aot_eager's, with their
compilers wrapped to count what they compile -- and `GraphCounts` reads the counts around any
block of code:

* ``graphs_forward``: graphs Dynamo compiled (``torch._dynamo.utils.counters``);
* ``graphs_backward``: backward graphs AOTAutograd handed the backward compiler;
* ``graph_breaks`` (and ``break_reasons``): where Dynamo gave up a graph;
* ``kernels``: what the compiled graphs launch when they run once -- inductor's generated kernels
  plus the ops it leaves to aten (extern calls: GEMMs, random draws, collectives); under aot_eager,
  which fuses nothing, the aten ops of the graphs.

A dispatch mode (`bigdense.testing.counters.OpCounter`) cannot count a compiled step: Dynamo runs
eagerly while one is active. Count graphs here instead, with inductor's caches off (a cached graph
is loaded, not generated, and would count no kernels): `no_compile_caches`.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

_COUNTS = {"backward": 0, "kernels": 0}  # this process's, by the backends below


def backend_for(name: str):
    """The ``torch.compile`` backend for ``name`` ("inductor", "aot_eager", "eager"): the named
    backend with its compilers wrapped to count (see the module docstring); "eager" as it is."""
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        return functools.partial(aot_eager, fw_compiler=_counted(boxed_nop, backward=False),
                                 bw_compiler=_counted(boxed_nop, backward=True))
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return functools.partial(compile_fx, inner_compile=_counted_inductor)
    return name


def _counted(compiler, backward: bool):
    def count_then_compile(gm, example_inputs):
        _COUNTS["backward"] += backward
        _COUNTS["kernels"] += sum(node.op == "call_function" for node in gm.graph.nodes)
        return compiler(gm, example_inputs)

    return count_then_compile


def _counted_inductor(gm, example_inputs, **kwargs):
    import torch._inductor.metrics as metrics
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx_inner

    _COUNTS["backward"] += bool(kwargs.get("is_backward"))
    kernels, externs = metrics.generated_kernel_count, counters["inductor"]["extern_calls"]
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    _COUNTS["kernels"] += metrics.generated_kernel_count - kernels + counters["inductor"]["extern_calls"] - externs
    return compiled


@contextlib.contextmanager
def no_compile_caches():
    """Inductor's FX-graph and AOTAutograd caches off inside (so every graph is generated and counted)."""
    import torch
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@dataclass
class GraphCounts:
    """What torch.compile did inside a ``with`` block: Dynamo graphs compiled (``graphs_forward``),
    backward graphs compiled by AOTAutograd (``graphs_backward``), graph breaks taken
    (``graph_breaks``, from ``torch._dynamo.utils.counters``) and their reasons.

        with GraphCounts() as counts:
            engine.train_step(batch)        # first step: everything compiles here
        counts.graphs_forward, counts.graphs_backward, counts.graph_breaks

    Backward graphs and kernels are counted by the compilers of `backend_for`'s backends; a graph
    whose outputs need no gradient has no backward, and the ``eager`` backend counts neither."""

    graphs_forward: int = 0
    graphs_backward: int = 0
    graph_breaks: int = 0
    kernels: int = 0
    break_reasons: tuple = ()

    def __enter__(self) -> "GraphCounts":
        from torch._dynamo.utils import counters

        self._counters = counters
        self._start = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                       set(counters["graph_break"]))
        self._compiled = dict(_COUNTS)
        return self

    def __exit__(self, *exc) -> None:
        c = self._counters
        self.graphs_backward = _COUNTS["backward"] - self._compiled["backward"]
        self.kernels = _COUNTS["kernels"] - self._compiled["kernels"]
        graphs, breaks, reasons = self._start
        self.graphs_forward = c["stats"]["unique_graphs"] - graphs
        self.graph_breaks = sum(c["graph_break"].values()) - breaks
        self.break_reasons = tuple(sorted(set(c["graph_break"]) - reasons))

    def as_dict(self) -> dict:
        return dict(graphs_forward=self.graphs_forward, graphs_backward=self.graphs_backward,
                    graph_breaks=self.graph_breaks, kernels=self.kernels)
