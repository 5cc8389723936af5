"""Checkpoint costs on the reference GPT: the training stall of a save, the spread of writes over
DP replicas, and the bytes hashed on a resharding load.

    python -m bigdense.bench.checkpoint                   # GPT d=512, 4 layers, 32k vocab: ~350 MB with AdamW
    python -m bigdense.bench.checkpoint --d 256 --layers 2 --json out.json    # a quick look

1. tp=2, dp=1 (2 gloo CPU processes): a synchronous save, then an asynchronous one while training
   steps go on. The stall is the time ``save_checkpoint`` blocks the training loop (the slower
   rank's, median of ``--repeats``); the asynchronous save's total time runs until its handle's
   ``wait()`` returns.
2. tp=2, dp=2 (4 processes): the same synchronous save; bytes written per rank and total time
   against dp=1, where one DP replica writes everything per TP rank.
3. The tp=2 checkpoint loaded at tp=1, dp=2 (each rank needs every tensor whole): bytes copied and
   bytes hashed per rank with ``verify="all"`` (every reader hashes what it reads: the baseline)
   against the default ``verify="node"`` (each stored byte hashed once on the node).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _everywhere(flag: bool) -> bool:
    """``flag`` on every rank (ranks must agree on how many training steps they run)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t)


def _build(args, tp):
    import bigdense as bd
    from bigdense.models import GPT, GPTConfig

    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, d_model=args.d, n_layers=args.layers, n_heads=8, max_seq_len=64),
                tp_group=ctx.tp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return ctx, model, opt


def _step(model, opt, args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2, 32), generator=g)
    model(ids, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _saves(args, root: str, tp: int, with_async: bool):
    import bigdense as bd

    ctx, model, opt = _build(args, tp)
    _step(model, opt, args)
    out = {}
    # Warm-up saves: first-call costs and the background saves' process group stay out of the timings.
    bd.save_checkpoint(f"{root}/warm", model, opt, step=0)
    if with_async:
        bd.save_checkpoint(f"{root}/warm", model, opt, step=0, async_=True).wait()
    sync = []
    for r in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        bd.save_checkpoint(f"{root}/sync{r}", model, opt, step=1)
        sync.append(_slowest(time.perf_counter() - t0))
    out["sync_stall_s"] = statistics.median(sync)
    if with_async:
        step_times = []
        for _ in range(args.steps):  # the step time with no save in flight
            t = time.perf_counter()
            _step(model, opt, args)
            step_times.append(time.perf_counter() - t)
        stalls, totals, during = [], [], []
        for r in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            handle = bd.save_checkpoint(f"{root}/async{r}", model, opt, step=2, async_=True)
            stalls.append(_slowest(time.perf_counter() - t0))
            while not _everywhere(handle.done()):  # training goes on while the save writes
                t = time.perf_counter()
                _step(model, opt, args)
                during.append(time.perf_counter() - t)
            handle.wait()
            totals.append(_slowest(time.perf_counter() - t0))
        out["async_stall_s"] = statistics.median(stalls)
        out["async_total_s"] = statistics.median(totals)
        out["step_s"] = statistics.median(step_times)
        out["step_during_save_s"] = statistics.median(during) if during else float("nan")
    manifest = json.loads((Path(root) / "sync0" / "manifest.json").read_text())
    out["bytes_written_per_rank"] = manifest["bytes_written_per_rank"]
    bd.destroy_parallel()
    return out


def _load(args, ckpt: str, verify: str):
    import bigdense as bd

    ctx, model, opt = _build(args, tp=1)
    dist.barrier()
    t0 = time.perf_counter()
    info = bd.load_checkpoint(ckpt, model, opt, verify=verify)
    seconds = _slowest(time.perf_counter() - t0)
    bd.destroy_parallel()
    return {"load_s": seconds, "bytes_hashed": info.bytes_hashed, "bytes_copied": info.bytes_copied}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3, help="training steps timed without a save in flight")
    parser.add_argument("--repeats", type=int, default=3, help="saves timed per kind (the median is printed)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import tempfile

    from bigdense.testing import run_ranks

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        dp1 = run_ranks(_saves, 2, args, f"{root}/dp1", 2, True, timeout=3600, collective_timeout=1200)[0]
        dp2 = run_ranks(_saves, 4, args, f"{root}/dp2", 2, False, timeout=3600, collective_timeout=1200)[0]
        loads = {v: run_ranks(_load, 2, args, f"{root}/dp1/sync0", v, timeout=3600, collective_timeout=1200)
                 for v in ("all", "node")}
    mb = 1e6
    total = sum(dp1["bytes_written_per_rank"])
    print(f"GPT d={args.d}, {args.layers} layers, vocab {args.vocab}, fp32 + AdamW: checkpoint {total / mb:.0f} MB; "
          f"gloo CPU processes x 1 thread")
    print(f"1. training-step stall of a save, tp=2 dp=1 (slower rank, median of {args.repeats})")
    print(f"   synchronous (baseline): {dp1['sync_stall_s']:.3f} s")
    print(f"   asynchronous:           {dp1['async_stall_s']:.3f} s   ratio {dp1['async_stall_s'] / dp1['sync_stall_s']:.3f}"
          f"  (target < 0.10); background save done after {dp1['async_total_s']:.3f} s")
    print(f"   training step {dp1['step_s']:.3f} s alone, {dp1['step_during_save_s']:.3f} s while the save writes")
    print("2. writes per rank, tp=2: dp=1 (baseline) vs dp=2")
    print(f"   dp=1: {[round(b / mb, 1) for b in dp1['bytes_written_per_rank']]} MB, total {dp1['sync_stall_s']:.3f} s")
    print(f"   dp=2: {[round(b / mb, 1) for b in dp2['bytes_written_per_rank']]} MB, total {dp2['sync_stall_s']:.3f} s"
          f"   max per rank ratio {max(dp2['bytes_written_per_rank']) / max(dp1['bytes_written_per_rank']):.3f}")
    print("3. load at another layout (saved tp=2 dp=1, loaded tp=1 dp=2): per rank")
    for v, label in (("all", "verify=all (baseline)"), ("node", "verify=node (default)")):
        r = loads[v]
        print(f"   {label:22s}: copied {[round(x['bytes_copied'] / mb, 1) for x in r]} MB, hashed "
              f"{[round(x['bytes_hashed'] / mb, 1) for x in r]} MB, {r[0]['load_s']:.3f} s")
    ratio = max(x["bytes_hashed"] for x in loads["node"]) / max(x["bytes_hashed"] for x in loads["all"])
    print(f"   max hashed per rank ratio node / all = {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"dp1": dp1, "dp2": dp2, "loads": loads}, indent=1))


if __name__ == "__main__":
    main()
