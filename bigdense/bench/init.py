"""What initialising a big layer costs: kernels, host syncs and time, tile loop vs counter-based.

    python -m bigdense.bench.init                       # ColumnParallelLinear(4096, 16384), ~1 min on 2 cores
    python -m bigdense.bench.init --in 1024 --out 4096 --iters 3 --json init.jsonl

Builds ``ColumnParallelLinear(in, out)`` (one process, tp=1: the whole weight) with two variants
of each law, in the same run: ``baseline`` draws the weight tile by tile, one torch.Generator per
512 x 512 tile (`tiled_fill_` with the per-tile fill the named schemes used to have, kept here as
`_tiled`), ``current`` is the named scheme (counter-based `counter_fill_`). The bias is drawn the
current way in both. Counts every aten op of the weight's init (`bigdense.testing.counters.OpCounter`; views
apart) as an accelerator would launch them: the baseline's on CPU (the same tiles on any device),
the current one's on the meta device (``CHUNK``-sized blocks; CPU draws cache-sized ``CPU_CHUNK``
blocks instead). Times the CPU build: variants alternate so machine noise hits both alike; median.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import bigdense as bd
from bigdense.bench import append_json_lines
from bigdense.testing.counters import OpCounter
from bigdense.layers.init import INITIALIZERS, Initializer


def _tiled(name: str) -> Initializer:
    """The named law drawn the tile-loop way (same name, so the bias law is the same)."""
    def fill(t, g, fan_in, fan_out):
        if name == "torch":
            bound = 1.0 / math.sqrt(fan_in)
            t.uniform_(-bound, bound, generator=g)
        else:
            t.normal_(0.0, 1.0, generator=g)

    return Initializer(name, fill)


def _build(init, in_features: int, out_features: int) -> float:
    start = time.perf_counter()
    bd.ColumnParallelLinear(in_features, out_features, init=init)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in", dest="in_features", type=int, default=4096)
    parser.add_argument("--out", dest="out_features", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", help="append one JSON object per result to this file")
    args = parser.parse_args(argv)
    shape = (args.in_features, args.out_features)
    print(f"ColumnParallelLinear{shape} build, tp=1, fp32, {torch.get_num_threads()} CPU thread(s), "
          f"median of {args.iters}, variants interleaved")
    results = []
    for name in ("torch", "normal"):
        variants = {"baseline": _tiled(name), "current": INITIALIZERS[name]}
        ops, syncs = {}, {}
        for kind, init in variants.items():
            weight = torch.empty(shape[1], shape[0], device="cpu" if kind == "baseline" else "meta")
            with OpCounter() as counter:
                init.init_(weight, weight.shape, (0, 0), seed=1)
            ops[kind], syncs[kind] = counter.ops, counter.syncs
        times = {kind: [] for kind in variants}
        for _ in range(args.iters):
            for kind, init in variants.items():
                times[kind].append(_build(init, *shape))
        med = {kind: statistics.median(ts) for kind, ts in times.items()}
        print(f"  init={name:7s} weight init aten ops: baseline {ops['baseline']:6d}   current {ops['current']:4d}   "
              f"ratio {ops['baseline'] / ops['current']:6.1f}x   host syncs: {syncs['baseline']} vs {syncs['current']}")
        print(f"  init={name:7s} layer build time:    baseline {med['baseline']:6.2f} s   current {med['current']:6.2f} s   "
              f"ratio {med['baseline'] / med['current']:.2f}x")
        results.append(dict(bench="init", init=name, in_features=shape[0], out_features=shape[1],
                            ops_baseline=ops["baseline"], ops_current=ops["current"],
                            time_s_baseline=med["baseline"], time_s_current=med["current"]))
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    main()
