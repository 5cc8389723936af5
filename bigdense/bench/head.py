"""Classifier head with a huge number of classes: time and peak memory of mean cross-entropy, fwd+bwd.

    python -m bigdense.bench.head                       # 1024 -> 131,072 classes, 4,096 tokens, fp32
    python -m bigdense.bench.head --classes 8192 --tokens 512 --iters 2 --warmup 1   # a quick smoke run
    python -m bigdense.bench.head --suite xc            # sampled / world / margin (bench/head_xc.py)
    python -m bigdense.bench.head --gpu-proxy [--json F] # the GPU path's launches, bytes, peak (bench/head_proxy.py)
    python -m bigdense.bench.head --grad-accuracy        # the GPU path in bf16 vs float64 (bench/head_grad_accuracy.py)

Contenders, each in fresh processes (spawned, so each peak RSS is its own; ``--start-method fork``
starts them faster for tests, their RSS then including this process's pages):

* ``unsharded``: ``nn.Linear`` + ``F.cross_entropy`` in one process with 2 threads -- the baseline;
* ``bigdense``: `ParallelClassifierHead.loss` at tp=2, two gloo CPU processes with 1 thread each;
* ``dtensor``: PyTorch's DTensor, ``ColwiseParallel(use_local_output=False)`` on the ``nn.Linear`` and
  ``F.cross_entropy`` under ``loss_parallel()``, tp=2, 1 thread each;
* ``bigdense-recompute`` (not run by default): bigdense with ``grad_strategy="recompute"``.

All use the same weights (nn.Linear's law, generated tile by tile from a fixed seed, so a rank
builds only its own rows) and the same inputs. One iteration: forward, backward with ``h``
requiring grad, and a read of the gradients. Printed per contender: the median over ``--iters``
iterations after ``--warmup`` (for TP, each iteration's time is the slowest rank's) and the
minimum (the steadier figure on a shared machine), the median CPU seconds of the busiest rank per
iteration (all its threads; time spent waiting for a descheduled peer is not in it), peak RSS of each rank (VmHWM, which includes
the ~0.24 GB of an idle process with torch and gloo), the median's ratio against the unsharded
baseline, and the loss (the same for all, as a check). For reading, not asserting.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import SEED, append_json_lines, peak_rss_bytes



@torch.no_grad()
def _fill_rows(weight: torch.Tensor, bias, row_start: int, args) -> None:
    """Rows ``[row_start, row_start + len(weight))`` of the benchmark's full weight and bias."""
    from bigdense.layers.init import INITIALIZERS, init_bias_

    torch_law = INITIALIZERS["torch"]
    torch_law.init_(weight, (args.classes, args.features), (row_start, 0), SEED)
    if bias is not None:
        init_bias_(bias, torch_law, args.features, args.classes, row_start, SEED)


def _inputs(args):
    g = torch.Generator().manual_seed(SEED + 1)
    h = torch.randn(args.tokens, args.features, generator=g)
    target = torch.randint(0, args.classes, (args.tokens,), generator=g)
    return h, target


def _time(step, args, group=None) -> list[tuple[float, float]]:
    """(wall, CPU) seconds per timed iteration; CPU time is this process's, all threads, waits excluded."""
    times = []
    for i in range(args.warmup + args.iters):
        if group is not None:
            dist.barrier(group=group)
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if i >= args.warmup:
            times.append((elapsed, cpu))
    return times


def _unsharded(args):
    torch.set_num_threads(2)
    linear = nn.Linear(args.features, args.classes, bias=args.bias, device="meta")
    linear.to_empty(device="cpu")
    _fill_rows(linear.weight, linear.bias, 0, args)
    h, target = _inputs(args)
    losses = []

    def step():
        x = h.clone().requires_grad_()
        loss = F.cross_entropy(linear(x), target)
        loss.backward()
        losses.append(loss.item() + x.grad.sum().item() * 0 + linear.weight.grad[0, 0].item() * 0)
        linear.zero_grad(set_to_none=True)

    return _time(step, args), peak_rss_bytes(), losses[-1]


def _bigdense(args, strategy):
    import bigdense as bd

    torch.set_num_threads(1)
    ctx = bd.init_parallel(tp=args.tp)
    head = bd.ParallelClassifierHead(
        args.features, args.classes, bias=args.bias, chunk_size=args.chunk_size, grad_strategy=strategy, device="meta"
    )
    head.to_empty(device="cpu")
    _fill_rows(head.weight, head.bias, head.class_start, args)
    h, target = _inputs(args)
    losses = []

    def step():
        x = h.clone().requires_grad_()
        loss = head.loss(x, target)
        loss.backward()
        losses.append(loss.item() + x.grad.sum().item() * 0 + head.weight.grad[0, 0].item() * 0)
        head.zero_grad(set_to_none=True)

    return _time(step, args, ctx.tp_group), peak_rss_bytes(), losses[-1]


def _dtensor(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.tp,))
    # Built on meta and sharded there, so no rank ever holds the full weight.
    linear = nn.Linear(args.features, args.classes, bias=args.bias, device="meta")
    parallelize_module(linear, mesh, ColwiseParallel(use_local_output=False))
    linear.to_empty(device="cpu")
    # Shard(0) splits like torch.chunk: ceil(classes / tp) rows per rank, the last rank the rest.
    row_start = dist.get_rank() * math.ceil(args.classes / args.tp)
    _fill_rows(linear.weight.to_local(), None if linear.bias is None else linear.bias.to_local(), row_start, args)
    h, target = _inputs(args)
    losses = []

    def step():
        x = h.clone().requires_grad_()
        with loss_parallel():
            loss = F.cross_entropy(linear(x), target)
            loss.backward()
        grad_w = linear.weight.grad.to_local()
        losses.append(loss.full_tensor().item() + x.grad.sum().item() * 0 + grad_w[0, 0].item() * 0)
        linear.zero_grad(set_to_none=True)

    return _time(step, args, dist.group.WORLD), peak_rss_bytes(), losses[-1]


def _contender(name, args):
    """Runs in the spawned rank process(es)."""
    if name == "unsharded":
        return _unsharded(args)
    if name == "dtensor":
        return _dtensor(args)
    return _bigdense(args, "recompute" if name == "bigdense-recompute" else "forward")


CONTENDERS = ("unsharded", "bigdense", "dtensor", "bigdense-recompute")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bigdense.bench.head", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="tp", choices=("tp", "sampled", "world", "accuracy", "bf16", "xc"),
                        help="tp: the contenders below; the others: see bigdense/bench/head_xc.py")
    parser.add_argument("--features", type=int, default=None, help="default 1024 (tp), 512 (bf16), 128 (others)")
    parser.add_argument("--classes", type=int, default=None,
                        help="default 131,072 (tp), 1,000,000 (sampled), 200,000 (world), 65,536 (bf16)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=240, help="accuracy: training steps (top-1 also at half-way)")
    parser.add_argument("--acc-classes", type=int, default=20_000, help="accuracy: classes (at least 3)")
    parser.add_argument("--acc-batch", type=int, default=1024, help="accuracy: batch")
    parser.add_argument("--acc-lr", type=float, default=1e-2, help="accuracy: AdamW learning rate, every head")
    parser.add_argument("--acc-scale", type=float, default=None,
                        help="accuracy: scale s of the margin heads (default: AdaCos's sqrt(2) ln(classes - 1))")
    parser.add_argument("--acc-eval", default="test", choices=("test", "validation"),
                        help="accuracy: the held-out draw scored (choose hyper-parameters on validation)")
    parser.add_argument("--noise", type=float, default=0.6, help="accuracy: std of the samples around their centre")
    parser.add_argument("--before", default=None, help="bf16: a git revision whose fused loss is measured too")
    parser.add_argument("--world-engines", nargs="+", default=["ddp", "deepspeed"], choices=("ddp", "deepspeed"),
                        help="world: the DP engines compared (DeepSpeed at ZeRO-1)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=None, help="bigdense tokens per chunk (default: auto)")
    parser.add_argument("--no-bias", dest="bias", action="store_false", help="heads without bias")
    parser.add_argument(
        "--contenders", default="unsharded,bigdense,dtensor",
        help=f"comma-separated, run in this order; any of {', '.join(CONTENDERS)}",
    )
    parser.add_argument("--json", help="append one JSON object per result to this file")
    parser.add_argument("--gpu-proxy", action="store_true",
                        help="trace the head's GPU path on the meta device at three LLM shapes (bench/head_proxy.py)")
    parser.add_argument("--grad-accuracy", action="store_true",
                        help="the GPU path's bf16 loss and gradients against float64 (bench/head_grad_accuracy.py); "
                             "--classes sets the reduced class count (default 2048)")
    parser.add_argument("--proxy-path", default="kernels", choices=("kernels", "off"),
                        help="--gpu-proxy: the GPU loop (default) or the CPU-shaped loop it replaces")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "fork"),
                        help="how contender processes start: spawn (default) gives each its own peak RSS; fork starts "
                             "in milliseconds but its RSS includes pages of this process (for tests)")
    args = parser.parse_args(argv)
    if args.acc_classes < 3 or args.steps < 2:
        parser.error(f"--acc-classes must be at least 3 and --steps at least 2, got {args.acc_classes} and {args.steps}")
    if args.gpu_proxy:
        from . import head_proxy

        return head_proxy.run(args.json, args.proxy_path)
    if args.grad_accuracy:
        from . import head_grad_accuracy

        return head_grad_accuracy.run(args.classes or 2048, args.json)
    if args.suite != "tp":
        from . import head_xc

        return head_xc.run(args)
    args.features, args.classes = args.features or 1024, args.classes or 131_072
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")

    from bigdense.bench import head as this  # importable by name in the spawned processes
    from bigdense.testing import run_ranks

    logits_gib = args.tokens * args.classes * 4 / 2**30
    print(
        f"head {args.features} -> {args.classes} classes, {args.tokens} tokens, fp32, bias={args.bias}, mean "
        f"cross-entropy, fwd+bwd; full logits {logits_gib:.2f} GiB; median of {args.iters} after {args.warmup} warm-up"
    )
    budget = 600 + 60 * (args.iters + args.warmup) * max(1.0, args.tokens * args.classes * args.features / 5.5e11)
    baseline, rows = None, []
    for name in names:
        world = 1 if name == "unsharded" else args.tp
        results = run_ranks(
            this._contender, world, name, args, start_method=args.start_method, timeout=budget, collective_timeout=budget,
            init_process_group=world > 1,
        )
        # The slowest rank sets the pace.
        per_iter = [max(wall for wall, _ in ranks) for ranks in zip(*(r[0] for r in results))]
        cpu = statistics.median(max(c for _, c in ranks) for ranks in zip(*(r[0] for r in results)))
        median = statistics.median(per_iter)
        baseline = median if name == "unsharded" else baseline
        rss = ", ".join(f"{r[1] / 1e9:.2f}" for r in results)
        ratio = f"{median / baseline:.2f}x unsharded" if baseline else "(no baseline run)"
        threads = "2 threads" if world == 1 else f"tp={world}, 1 thread each"
        label = f"{name} ({threads})"
        print(
            f"{label:<40} median {median:7.2f} s  min {min(per_iter):7.2f} s  "
            f"[{', '.join(f'{t:.2f}' for t in per_iter)}]  CPU {cpu:6.2f} s/rank  "
            f"peak RSS/rank {rss} GB  {ratio}  loss {results[0][2]:.6f}",
            flush=True,
        )
        rows.append(dict(suite="tp", contender=name, median_s=median, times_s=per_iter, cpu_s=cpu,
                         ratio_vs_unsharded=median / baseline if baseline else None,
                         peak_rss_bytes=[r[1] for r in results], loss=results[0][2]))
    if args.json:
        append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
