"""Column→GELU→Row MLP against PyTorch's own tensor parallelism, on the same weights and inputs.

    python -m bigdense.bench.mlp                      # d=1024, hidden=4096, x (8, 128, 1024), tp=2
    python -m bigdense.bench.mlp --iters 5 --d 256    # a quick look

Both contenders run in the same two gloo CPU processes, one thread each, interleaved iteration by
iteration so that machine noise hits both alike. An iteration is forward + backward with ``x``
requiring grad, timed until the input grad has been read (DTensor's backward all-reduce of the
input grad is asynchronous; reading it makes the timer include it). Per iteration the slower
rank's time counts. The unsharded nn.Linear MLP with 2 threads in one process is printed for
reference.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def _time_step(model, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    y = model(x)
    y.sum().backward()
    float(x.grad.sum())  # waits for any outstanding collective on the input grad
    elapsed = time.perf_counter() - start
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    x.grad = None
    model.zero_grad(set_to_none=True)
    return float(slowest)


def _ranks(args):
    import bigdense as bd
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ctx = bd.init_parallel(tp=args.tp)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(args.d, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.d))
    ours = nn.Sequential(
        bd.ColumnParallelLinear.from_dense(dense[0]), nn.GELU(), bd.RowParallelLinear.from_dense(dense[2])
    )
    theirs = parallelize_module(
        copy.deepcopy(dense), ctx.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    x = torch.randn(args.batch, args.seq, args.d).requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)  # same function, or the race is moot

    contenders = {"DTensor": theirs, "bigdense": ours}
    times = {name: [] for name in contenders}
    for it in range(args.warmup + args.iters):
        order = list(contenders) if it % 2 == 0 else list(reversed(contenders))
        for name in order:
            t = _time_step(contenders[name], x)
            if it >= args.warmup:
                times[name].append(t)
    return times


def _unsharded(args) -> list[float]:
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(args.d, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.d))
    x = torch.randn(args.batch, args.seq, args.d).requires_grad_()
    times = []
    for it in range(args.warmup + args.iters):
        start = time.perf_counter()
        dense(x).sum().backward()
        float(x.grad.sum())
        if it >= args.warmup:
            times.append(time.perf_counter() - start)
        x.grad = None
        dense.zero_grad(set_to_none=True)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads-unsharded", type=int, default=2)
    args = parser.parse_args(argv)

    from bigdense.testing import run_ranks

    times = run_ranks(_ranks, args.tp, args, timeout=3600, collective_timeout=600)[0]
    torch.set_num_threads(args.threads_unsharded)
    reference = _unsharded(args)

    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(
        f"MLP {args.d}->{args.hidden}->{args.d}, GELU, x ({args.batch}, {args.seq}, {args.d}), fp32, "
        f"forward+backward, tp={args.tp} on {args.tp} gloo CPU processes x 1 thread, "
        f"median of {args.iters} after {args.warmup} warm-up"
    )
    print(f"  PyTorch DTensor Colwise/RowwiseParallel (baseline): {med['DTensor']:8.1f} ms")
    print(f"  bigdense ColumnParallel/RowParallelLinear:          {med['bigdense']:8.1f} ms")
    print(f"  unsharded nn.Linear, 1 process x {args.threads_unsharded} threads (reference): "
          f"{statistics.median(reference) * 1e3:8.1f} ms")
    print(f"  ratio bigdense / DTensor = {med['bigdense'] / med['DTensor']:.3f}  (target <= 1.0)")


if __name__ == "__main__":
    main()
