"""Extreme-classification measurements of `ParallelClassifierHead` (``python -m bigdense.bench.head --suite ...``).

    --suite sampled    1,000,000 classes x d=128, 4,096 tokens, fp32, tp=2: sample_rate 1.0 vs 0.3 vs 0.1,
                       time of the fused loss fwd+bwd and peak RSS per rank (the same weights and inputs)
    --suite world      tp=1 x dp=2 under the DDP engine and DeepSpeed ZeRO-1, AdamW: shard="world" vs
                       shard="tp": bytes the DP engine's collectives move per step (DDP's buckets, counted by
                       a comm hook; DeepSpeed's, counted at its comm backend), step time, peak RSS
    --suite accuracy   20,000 classes with Gaussian centres in 64 dims, fresh samples each step: held-out
                       top-1 after the same steps, data and seed for softmax at r=1.0 and r=0.1, ArcFace
                       and CosFace (at AdaCos's scale for the class count), every head under one AdamW
                       learning rate; the nearest-true-centre rule as the ceiling (one process, 2 threads)
    --suite bf16       the fused loss under bf16 autocast, fwd+bwd, tp=2: this tree, and with
                       ``--before REF`` the same loss from git revision REF (``git archive``), same run
    --suite xc         all four

Sizes are flags (``--classes``, ``--features``, ``--tokens``, ``--steps``); each contender runs in
fresh spawned processes so each peak RSS (VmHWM) is its own (``--start-method fork``, for tests,
starts them faster, their RSS then including this process's pages). Ratios are against the first
contender of the suite, measured in the same run; ``--json PATH`` appends one object per result.
For reading, not asserting.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import torch
import torch.nn as nn

from . import SEED, append_json_lines, peak_rss_bytes


# ---- sampled softmax: time and memory -------------------------------------------------------
def _sampled_rank(args, rate):
    import bigdense as bd

    torch.set_num_threads(1)
    ctx = bd.init_parallel(tp=args.tp)
    torch.manual_seed(SEED)
    head = bd.ParallelClassifierHead(args.features, args.classes, bias=False, sample_rate=rate, device="meta")
    head.to_empty(device="cpu")
    head.reset_parameters()
    g = torch.Generator().manual_seed(SEED + 1)
    h = torch.randn(args.tokens, args.features, generator=g)
    target = torch.randint(0, args.classes, (args.tokens,), generator=g)
    times, losses = [], []
    for i in range(args.warmup + args.iters):
        torch.distributed.barrier(group=ctx.tp_group)
        start = time.perf_counter()
        x = h.clone().requires_grad_()
        loss = head.loss(x, target)
        loss.backward()
        losses.append(loss.item() + x.grad[0, 0].item() * 0 + head.weight.grad[0, 0].item() * 0)
        head.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, peak_rss_bytes(), losses[-1]


def _timing(results):
    """Per iteration the slowest rank's time (``results``: one ``(times, peak RSS, ...)`` per rank),
    their median, and the ranks' peak RSS in GB for printing."""
    per_iter = [max(ts) for ts in zip(*(r[0] for r in results))]
    return per_iter, statistics.median(per_iter), ", ".join(f"{r[1] / 1e9:.2f}" for r in results)


def suite_sampled(args, spawn):
    print(f"sampled softmax: {args.classes:,} classes x d={args.features}, {args.tokens:,} tokens, fp32, tp={args.tp} "
          f"(1 thread each), mean CE fwd+bwd, median of {args.iters} after {args.warmup} warm-up")
    base, rows = None, []
    for rate in (1.0, 0.3, 0.1):
        results = spawn(_sampled_rank, args.tp, args, rate)
        per_iter, median, rss = _timing(results)
        base = base or median
        print(f"  sample_rate={rate:<4}  median {median:7.2f} s  [{', '.join(f'{t:.2f}' for t in per_iter)}]  "
              f"peak RSS/rank {rss} GB  {base / median:5.2f}x faster than r=1.0  loss {results[0][2]:.4f}", flush=True)
        rows.append(dict(suite="sampled", sample_rate=rate, median_s=median, times_s=per_iter, speedup_vs_r1=base / median,
                         peak_rss_bytes=[r[1] for r in results], loss=results[0][2]))
    return rows


# ---- world vs tp sharding, under DDP and DeepSpeed ---------------------------------------------
class _Net(nn.Module):
    def __init__(self, args, shard):
        import bigdense as bd

        super().__init__()
        self.fc = nn.Linear(args.features, args.features)
        self.head = bd.ParallelClassifierHead(args.features, args.classes, bias=False, shard=shard)

    def forward(self, x, y):
        return self.head(torch.tanh(self.fc(x)), y)


def _counting_ddp_hook(engine, ctx, reduced: list) -> None:
    """DDP's all-reduce, recording the bytes of each bucket it reduces."""
    def hook(state, bucket):
        reduced.append(bucket.buffer().numel() * bucket.buffer().element_size())
        work = torch.distributed.all_reduce(bucket.buffer().div_(ctx.dp_size), group=ctx.dp_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    engine.wrapped.register_comm_hook(None, hook)


def _world_rank(args, shard, engine_kind):
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    from ..testing.counters import count_deepspeed_bytes

    torch.set_num_threads(1)
    ctx = bd.init_parallel(tp=1)
    torch.manual_seed(SEED)
    model = _Net(args, shard)
    per_rank = args.tokens // ctx.dp_size
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=engine_kind, zero_stage=1),
                             optim_cfg=OptimConfig(warmup_steps=1), precision_cfg=PrecisionConfig(),
                             micro_batch_size=per_rank, max_steps=100)
    reduced: list = []
    if engine_kind == "ddp":
        _counting_ddp_hook(engine, ctx, reduced)
    times = []
    for step in range(args.warmup + args.iters):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.tokens, args.features, generator=g)
        y = torch.randint(0, args.classes, (args.tokens,), generator=g)
        rows = slice(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
        reduced.clear()
        with count_deepspeed_bytes() if engine_kind == "deepspeed" else contextlib.nullcontext({}) as by_kind:
            start = time.perf_counter()
            result = engine.train_step([(x[rows], y[rows])])
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    # The DP engine's bytes in the last step: DDP's buckets (every parameter it was not told to
    # ignore), or DeepSpeed's collectives (ZeRO-1: the gradient all-reduce and the all-gather of
    # the updated partitions).
    moved = sum(reduced) + sum(by_kind.values())
    fc_bytes = sum(p.numel() * p.element_size() for p in model.fc.parameters())
    return times, peak_rss_bytes(), moved, fc_bytes, result.loss


def suite_world(args, spawn):
    head_mb = args.classes * args.features * 4 / 1e6
    print(f"world vs tp sharding: {args.classes:,} classes x d={args.features} ({head_mb:.0f} MB of weight), "
          f"{args.tokens:,} tokens per step over tp=1 x dp=2 (1 thread each), + AdamW, fp32, "
          f"median of {args.iters} after {args.warmup} warm-up; engines: {', '.join(args.world_engines)}")
    rows = []
    for engine_kind in args.world_engines:
        base = None
        for shard in ("tp", "world"):
            results = spawn(_world_rank, 2, args, shard, engine_kind)
            per_iter, median, rss = _timing(results)
            base = base or median
            moved, fc_bytes = results[0][2], results[0][3]
            print(f"  {engine_kind:<9} shard={shard:<6} DP collectives {moved / 1e6:8.2f} MB/step (the replicated "
                  f"layer's parameters: {fc_bytes / 1e6:.2f} MB)  step median {median:6.2f} s  "
                  f"[{', '.join(f'{t:.2f}' for t in per_iter)}]  {median / base:4.2f}x shard=tp  "
                  f"peak RSS/rank {rss} GB  loss {results[0][4]:.4f}", flush=True)
            rows.append(dict(suite="world", engine=engine_kind, shard=shard, dp_bytes=moved, fc_param_bytes=fc_bytes,
                             median_s=median, times_s=per_iter, ratio_vs_tp=median / base,
                             peak_rss_bytes=[r[1] for r in results], loss=float(results[0][4])))
    return rows


# ---- accuracy on a synthetic many-class problem ---------------------------------------------
# Held-out draws of fresh samples around the same centres: hyper-parameters are chosen on
# "validation" (``--acc-eval validation``), the figures reported on "test".
EVAL_SEEDS = {"test": SEED + 2, "validation": SEED + 3}
EVAL_SAMPLES = 8192


def adacos_scale(classes: int) -> float:
    """AdaCos's fixed scale ``sqrt(2) * ln(C - 1)``: with the C - 1 negatives at 90 degrees, a target
    at 45 degrees gets probability 1/2, so the loss separates near and far targets; a much larger
    ``s`` puts the softmax on the few hardest negatives."""
    return math.sqrt(2.0) * math.log(classes - 1)


def _gaussian_batch(centres, n, noise, generator):
    y = torch.randint(0, centres.shape[0], (n,), generator=generator)
    return centres[y] + noise * torch.randn(n, centres.shape[1], generator=generator), y


def _centres(args):
    return torch.randn(args.acc_classes, 64, generator=torch.Generator().manual_seed(SEED))


def _eval_batches(args, centres):
    g = torch.Generator().manual_seed(EVAL_SEEDS[args.acc_eval])
    return [_gaussian_batch(centres, 1024, args.noise, g) for _ in range(EVAL_SAMPLES // 1024)]


def _accuracy_run(args, options):
    import bigdense as bd

    torch.set_num_threads(2)
    centres = _centres(args)
    torch.manual_seed(SEED)
    encoder = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.LayerNorm(128))
    head = bd.ParallelClassifierHead(128, args.acc_classes, bias=options.get("margin") is None, **options)
    params = [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=args.acc_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(SEED + 1)
    held_out = _eval_batches(args, centres)
    top1, elapsed = [], 0.0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x, y = _gaussian_batch(centres, args.acc_batch, args.noise, g)
        loss = head.loss(encoder(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        elapsed += time.perf_counter() - start
        if step in (args.steps // 2, args.steps):  # half-way: how fast; the end: how well
            with torch.no_grad():
                hits = sum(int((head.predict(encoder(x), k=1)[1][:, 0] == y).sum()) for x, y in held_out)
            top1.append(hits / EVAL_SAMPLES)
    return top1, elapsed, loss.item()


def _nearest_centre_top1(args) -> float:
    """Top-1 of the rule that knows the true centres (nearest centre): the ceiling of the problem."""
    centres = _centres(args)
    hits = sum(int((torch.cdist(x, centres).argmin(1) == y).sum()) for x, y in _eval_batches(args, centres))
    return hits / EVAL_SAMPLES


def suite_accuracy(args, spawn):
    scale = adacos_scale(args.acc_classes) if args.acc_scale is None else args.acc_scale
    print(f"accuracy: {args.acc_classes:,} classes, Gaussian centres in 64 dims (noise {args.noise}), MLP encoder "
          f"-> head d=128, AdamW lr {args.acc_lr} for every head, {args.steps} steps of {args.acc_batch} fresh "
          f"samples, the same for all; margin heads at scale {scale:.2f} "
          f"({'AdaCos: sqrt(2) ln(C-1)' if args.acc_scale is None else '--acc-scale'}); "
          f"top-1 on {EVAL_SAMPLES:,} held-out {args.acc_eval} samples; one process, 2 threads")
    ceiling = _nearest_centre_top1(args)
    print(f"  {'nearest true centre':<15} top-1 {ceiling:6.1%}  (the problem's ceiling)")
    rows = [dict(suite="accuracy", head="nearest true centre", top1=ceiling)]
    contenders = [("softmax r=1.0", {}), ("softmax r=0.1", {"sample_rate": 0.1}),
                  ("ArcFace r=1.0", {"margin": "arcface"}), ("CosFace r=1.0", {"margin": "cosface"}),
                  ("ArcFace r=0.1", {"margin": "arcface", "sample_rate": 0.1})]
    base = None
    for label, options in contenders:
        options = {**options, "scale": scale} if "margin" in options else options
        ((half, top1), elapsed, loss), = spawn(_accuracy_run, 1, args, options)
        base = (half, top1) if base is None else base
        print(f"  {label:<15} top-1 {top1:6.1%}  ({(top1 - base[1]) * 100:+5.1f} points vs softmax r=1.0)  "
              f"at step {args.steps // 2}: {half:6.1%} ({(half - base[0]) * 100:+5.1f})  "
              f"train {elapsed:6.1f} s  last loss {loss:.3f}", flush=True)
        rows.append(dict(suite="accuracy", head=label, top1=top1, points_vs_softmax=(top1 - base[1]) * 100,
                         top1_half_way=half, points_vs_softmax_half_way=(half - base[0]) * 100,
                         train_s=elapsed, loss=loss, scale=options.get("scale")))
    for row in rows:
        row.update(classes=args.acc_classes, steps=args.steps, batch=args.acc_batch, lr=args.acc_lr,
                   noise=args.noise, eval=args.acc_eval)
    return rows


# ---- bf16 fused loss: this tree against an earlier one, in the same run ----------------------
def _bf16_rank(args, source):
    """The fused loss under bf16 autocast, from this tree or (``source``: a directory holding another
    revision's ``bigdense/``) from that one, imported afresh in this process."""
    import sys

    if source is not None:
        for name in [m for m in sys.modules if m == "bigdense" or m.startswith("bigdense.")]:
            if not name.startswith("bigdense.testing"):
                del sys.modules[name]
        sys.path.insert(0, source)
    import bigdense as bd

    if source is not None and not bd.__file__.startswith(source):
        raise RuntimeError(f"bigdense came from {bd.__file__}, not from {source}")
    torch.set_num_threads(1)
    ctx = bd.init_parallel(tp=args.tp)
    torch.manual_seed(SEED)
    head = bd.ParallelClassifierHead(args.features, args.classes, bias=False)
    g = torch.Generator().manual_seed(SEED + 1)
    h = torch.randn(args.tokens, args.features, generator=g)
    target = torch.randint(0, args.classes, (args.tokens,), generator=g)
    times = []
    for i in range(args.warmup + args.iters):
        torch.distributed.barrier(group=ctx.tp_group)
        start = time.perf_counter()
        x = h.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = head.loss(x, target)
        loss.backward()
        value = loss.item() + x.grad[0, 0].item() * 0 + head.weight.grad[0, 0].item() * 0
        head.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, peak_rss_bytes(), value


def suite_bf16(args, spawn):
    import pathlib
    import subprocess
    import tempfile

    print(f"bf16 fused loss: {args.classes:,} classes x d={args.features}, {args.tokens:,} tokens, tp={args.tp} "
          f"(1 thread each), autocast bf16, fwd+bwd, median of {args.iters} after {args.warmup} warm-up")
    contenders = [("this tree", None)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            repo = pathlib.Path(__file__).resolve().parents[2]
            archive = subprocess.run(["git", "-C", str(repo), "archive", args.before, "bigdense"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            contenders.insert(0, (f"before ({args.before})", tmp))
        else:
            print("  (no --before REF: only this tree is measured)")
        base, rows = None, []
        for label, source in contenders:
            results = spawn(_bf16_rank, args.tp, args, source)
            per_iter, median, rss = _timing(results)
            base = base or median
            print(f"  {label:<28} median {median:7.2f} s  [{', '.join(f'{t:.2f}' for t in per_iter)}]  "
                  f"{base / median:5.2f}x faster than the first  peak RSS/rank {rss} GB  loss {results[0][2]:.4f}",
                  flush=True)
            rows.append(dict(suite="bf16", tree=label, median_s=median, times_s=per_iter, speedup_vs_first=base / median,
                             peak_rss_bytes=[r[1] for r in results], loss=results[0][2]))
    return rows


SUITES = {"sampled": suite_sampled, "world": suite_world, "accuracy": suite_accuracy, "bf16": suite_bf16}
DEFAULT_CLASSES = {"sampled": 1_000_000, "world": 200_000, "accuracy": None, "bf16": 65_536}


def run(args) -> None:
    from bigdense.bench import head_xc as this  # importable by name in the spawned processes
    from bigdense.testing import run_ranks

    def spawn(fn, world, *fn_args):
        name = fn.__name__
        return run_ranks(getattr(this, name), world, *fn_args, start_method=args.start_method, timeout=3600,
                         collective_timeout=3600, init_process_group=world > 1)

    for name in (SUITES if args.suite == "xc" else [args.suite]):
        suite_args = copy.copy(args)
        suite_args.features = args.features or (512 if name == "bf16" else 128)
        suite_args.classes = args.classes or DEFAULT_CLASSES[name]
        rows = SUITES[name](suite_args, spawn)
        if args.json:
            append_json_lines(args.json, rows)
