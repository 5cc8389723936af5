"""The reference GPT, the MLP and the head on GPUs: step time, tokens/s, MFU, peak memory.

    python -m bigdense.bench.gpu --json gpu.jsonl            # about 5 minutes on one H100/H200
    python -m bigdense.bench.gpu --quick --json gpu.jsonl    # gpt_small only, fewer steps
    python -m bigdense.bench.gpu --peers [--profile]         # only the head against Liger, CCE, torch (bench/head_gpu.py)

On a CUDA machine, for ``gpt_small`` (124M) and ``gpt_1b`` (a ~1B-parameter config that fits one
device), in bf16 autocast with fp32 master weights, at tp = 1 and every TP size the GPUs allow
(a divisor of the heads up to ``torch.cuda.device_count()``; tp > 1 runs one process per GPU on
NCCL), eager and with ``trainer.compile``'s per-block ``torch.compile``: the DDP engine's
``train_step`` timed with CUDA events over ``--steps`` steps after warm-up (compilation happens
in the warm-up), tokens/s, MFU (`bigdense.train.flops`: ``6N + 12 L d S`` FLOPs per token against
the device's dense bf16 peak) and peak memory. Then the MLP and the vocab-parallel head on one
GPU against plain PyTorch (nn.Linear MLP; nn.Linear + F.cross_entropy on the full logits).
Results print as a table; ``--json`` appends one JSON object per result. A run stops starting new
measurements after ``--budget-s`` seconds and reports what it skipped.

Without CUDA it says so and runs a 1-step smoke test of the same code path on CPU, then exits 0.
Needs torch only (no Hydra, no DeepSpeed): models are built from dataclasses.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

from . import append_json_lines

MODELS = {
    "gpt_small": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, seq=1024, batch=8),
    "gpt_1b": dict(d_model=2048, n_layers=18, n_heads=16, vocab_size=50304, seq=1024, batch=8),
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512, seq=32, batch=2),
}


def _gpt_case(model: str, tp: int, compiled: bool, steps: int, warmup: int, device: torch.device, ctx) -> dict:
    """One measurement on this rank; the result is the same dict on every rank (timings: max)."""
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.models.gpt import GPT, GPTConfig
    from bigdense.train.compile import compile_blocks
    from bigdense.train.engines import EngineSettings, build_engine
    from bigdense.train.flops import flops_per_token, mfu, peak_tflops

    spec = MODELS[model]
    cfg = GPTConfig(vocab_size=spec["vocab_size"], d_model=spec["d_model"], n_layers=spec["n_layers"],
                    n_heads=spec["n_heads"], max_seq_len=spec["seq"], dropout=0.1, head_chunk_size=4096)
    torch.manual_seed(0)
    with torch.device(device):
        net = GPT(cfg, tp_group=ctx.tp_group)
    if compiled:
        compile_blocks(net.blocks, "inductor" if device.type == "cuda" else "aot_eager")
    dtype = "bf16" if device.type == "cuda" else "fp32"
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(warmup_steps=10),
                              precision=PrecisionConfig(dtype=dtype), micro_batch_size=spec["batch"], max_steps=10**6)
    engine = build_engine(net, ctx, settings)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]), generator=gen).to(device)
    batch = [(idx, idx.roll(-1, dims=1))]
    with bd.set_checks(False):
        for _ in range(warmup):
            engine.train_step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                result = engine.train_step(batch)
            end.record()
            torch.cuda.synchronize(device)
            step_s = start.elapsed_time(end) / 1e3 / steps
            peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                result = engine.train_step(batch)
            step_s = (time.perf_counter() - t0) / steps
            peak_gb = float("nan")
    step_s = _max_over_ranks(step_s, ctx, device)
    tokens = spec["batch"] * spec["seq"]  # per step; TP ranks share the same tokens
    n_params = net.num_parameters()["total"]
    flops_token = flops_per_token(n_params, cfg.n_layers, cfg.d_model, spec["seq"])
    per_device = tokens / step_s / tp
    util = mfu(per_device, flops_token, peak_tflops(device))
    return dict(bench="gpu", case="gpt", model=model, params=n_params, tp=tp, compiled=compiled, precision=dtype,
                batch=spec["batch"], seq=spec["seq"], step_ms=step_s * 1e3, tokens_per_s=tokens / step_s,
                tokens_per_s_per_device=per_device, mfu=util, peak_mem_gb=peak_gb, loss=float(result.loss),
                device=_device_name(device))


def _max_over_ranks(value: float, ctx, device) -> float:
    if ctx.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _time_cuda(fn, iters: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms per call, peak GiB) of ``fn()`` on the current CUDA device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def _layer_cases(quick: bool) -> list[dict]:
    """The MLP and the head at tp=1 on one GPU, bf16 autocast, against plain PyTorch."""
    import torch.nn.functional as F

    import bigdense as bd
    from bigdense.layers.mlp import DenseMLP

    device = torch.device("cuda")
    iters = 10 if quick else 30
    out = []
    torch.manual_seed(0)
    d, hidden = 4096, 16384
    x = torch.randn(8, 1024, d, device=device, requires_grad=True)
    dense = DenseMLP(d, hidden, "gelu", device=device)
    ours = bd.ParallelMLP.from_dense(dense)

    def mlp_step(module):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                module(x).float().square().mean().backward()
        return run

    for name, module in (("torch nn.Linear MLP (baseline)", dense), ("bigdense ParallelMLP", ours)):
        ms, peak = _time_cuda(mlp_step(module), iters)
        out.append(dict(bench="gpu", case="mlp", contender=name, shape=f"x (8, 1024, {d}) -> {hidden} -> {d}",
                        ms=ms, peak_mem_gb=peak, device=_device_name(device)))
    del x, dense, ours
    tokens, d, classes = 8192, 2048, 131072
    h = torch.randn(tokens, d, device=device, requires_grad=True)
    target = torch.randint(0, classes, (tokens,), device=device)
    linear = torch.nn.Linear(d, classes, bias=False, device=device)
    head = bd.ParallelClassifierHead.from_dense(linear)

    def head_step(loss_fn):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_fn().backward()
        return run

    with bd.set_checks(False):
        for name, loss_fn in (
            ("torch linear + F.cross_entropy (baseline)", lambda: F.cross_entropy(linear(h).float(), target)),
            ("bigdense ParallelClassifierHead.loss", lambda: head.loss(h, target)),
        ):
            ms, peak = _time_cuda(head_step(loss_fn), iters)
            out.append(dict(bench="gpu", case="head", contender=name, shape=f"{tokens} tokens, {d} -> {classes} classes",
                            ms=ms, peak_mem_gb=peak, device=_device_name(device)))
    return out


def _cases(args, n_gpus: int) -> list[tuple]:
    models = ["gpt_small"] if args.quick else ["gpt_small", "gpt_1b"]
    out = []
    for model in models:
        heads = MODELS[model]["n_heads"]
        tps = [t for t in (1, 2, 4, 8) if t <= n_gpus and heads % t == 0]
        for tp in tps:
            for compiled in (False, True):
                out.append((model, tp, compiled))
    return out


def _worker(rank: int, world: int, port: int, cases: list, args, queue) -> None:
    """One rank of a tp=world run on NCCL: every case, results (rank 0's) into ``queue``."""
    import datetime

    import torch.distributed as dist

    import bigdense as bd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    ctx = bd.init_parallel(tp=world)
    for model, tp, compiled in cases:
        try:
            result = _gpt_case(model, tp, compiled, args.steps, args.warmup, torch.device("cuda", rank), ctx)
        except Exception:  # noqa: BLE001 - one failed case must not hide the others
            result = dict(bench="gpu", case="gpt", model=model, tp=tp, compiled=compiled, error=traceback.format_exc(limit=3))
        if rank == 0:
            queue.put(result)
        torch._dynamo.reset()
    dist.destroy_process_group()


def _run_tp(world: int, cases: list, args) -> list[dict]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_worker, args=(r, world, port, cases, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.time() + args.budget_s
    while len(results) < len(cases) and time.time() < deadline and any(p.is_alive() for p in procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: poll again
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return results


def _print_table(results: list[dict]) -> None:
    gpt = [r for r in results if r.get("case") == "gpt"]
    if gpt:
        print(f"{'model':10s} {'params':>7s} {'tp':>3s} {'mode':9s} {'step ms':>9s} {'tokens/s':>11s} "
              f"{'tok/s/dev':>10s} {'MFU':>6s} {'peak GiB':>9s}")
        for r in gpt:
            mode = "compiled" if r["compiled"] else "eager"
            if "error" in r:
                print(f"{r['model']:10s} {'':>7s} {r['tp']:3d} {mode:9s} failed: {r['error'].strip().splitlines()[-1]}")
                continue
            util = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            print(f"{r['model']:10s} {r['params'] / 1e6:6.0f}M {r['tp']:3d} {mode:9s} {r['step_ms']:9.1f} "
                  f"{r['tokens_per_s']:11,.0f} {r['tokens_per_s_per_device']:10,.0f} {util:>6s} {r['peak_mem_gb']:9.2f}")
    for r in results:
        if r.get("case") not in ("gpt",) and "error" in r:
            print(f"{r['case']}: failed: {r['error'].strip().splitlines()[-1]}")
    for case in ("mlp", "head"):
        rows = [r for r in results if r.get("case") == case]
        if rows:
            print(f"{case}: {rows[0]['shape']}, bf16 autocast, forward + backward, median")
            for r in rows:
                print(f"  {r['contender']:45s} {r['ms']:8.2f} ms   peak {r['peak_mem_gb']:6.2f} GiB")
            print(f"  ratio bigdense / torch: {rows[1]['ms'] / rows[0]['ms']:.2f} (time), "
                  f"{rows[1]['peak_mem_gb'] / rows[0]['peak_mem_gb']:.2f} (peak memory)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gpt_small only, fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (default 20, quick 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no new measurement after this")
    parser.add_argument("--json", help="append one JSON object per result to this file")
    parser.add_argument("--peers", action="store_true",
                        help="only the fused linear + cross-entropy against torch, Liger and Cut Cross-Entropy "
                             "(bench/head_gpu.py; the gpu-peers extra installs the peers)")
    parser.add_argument("--profile", action="store_true", help="--peers: the top kernels of one bigdense call")
    parser.add_argument("--head-iters", type=int, default=10, help="--peers: timed calls per contender")
    args = parser.parse_args(argv)
    args.steps = args.steps or (10 if args.quick else 20)
    started = time.time()

    if not torch.cuda.is_available():
        print("bigdense.bench.gpu: no CUDA device here; running a 1-step smoke test of the benchmark on CPU "
              "(no GPU figures).")
        import bigdense as bd

        ctx = bd.init_parallel(tp=1)
        results = [dict(_gpt_case("smoke", 1, False, 1, 0, torch.device("cpu"), ctx), smoke=True)]
        _emit(results, args)
        return 0

    if args.peers:
        from . import head_gpu

        _emit(head_gpu.run(args.head_iters, args.profile), args)
        return 0
    n_gpus = torch.cuda.device_count()
    print(f"bigdense.bench.gpu: {n_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"TP sizes up to {n_gpus}")
    results: list[dict] = []
    cases = _cases(args, n_gpus)
    import bigdense as bd

    ctx = bd.init_parallel(tp=1)
    for model, tp, compiled in [c for c in cases if c[1] == 1]:
        if time.time() - started > args.budget_s:
            results.append(dict(bench="gpu", case="gpt", model=model, tp=tp, compiled=compiled, error="skipped: time budget"))
            continue
        try:
            results.append(_gpt_case(model, tp, compiled, args.steps, args.warmup, torch.device("cuda", 0), ctx))
        except Exception:  # noqa: BLE001 - one failed case must not hide the others
            results.append(dict(bench="gpu", case="gpt", model=model, tp=tp, compiled=compiled,
                                error=traceback.format_exc(limit=3)))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(f"  done: {model} tp={tp} {'compiled' if compiled else 'eager'} ({time.time() - started:.0f} s)", flush=True)
    try:
        results.extend(_layer_cases(args.quick))
    except Exception:  # noqa: BLE001
        results.append(dict(bench="gpu", case="layers", error=traceback.format_exc(limit=3)))
    for tp in sorted({c[1] for c in cases if c[1] > 1}):
        if time.time() - started > args.budget_s:
            break
        args.budget_s = max(30.0, args.budget_s - (time.time() - started))
        results.extend(_run_tp(tp, [c for c in cases if c[1] == tp], args))
    _emit(results, args)
    return 0


def _emit(results: list[dict], args) -> None:
    _print_table(results)
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
