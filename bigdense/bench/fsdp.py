"""FSDP2 (``engine=fsdp``) against DDP (``engine=ddp``) at tp=2 x dp=2: memory, collectives, step time.

    python -m bigdense.bench.fsdp                          # gpt_small memory + a GPT d=256 x 4: ~4 min on 2 cores
    python -m bigdense.bench.fsdp --quick --json fsdp.jsonl

Both engines get the same model, seed, data and AdamW (fp32, fused), built as the training job
builds them (`bd.build_engine` on a GPT made with ``ctx.tp_group``); each DP rank feeds its rows of
the global batch. Four ranks: gloo CPU processes x 1 thread, or, with ``--device cuda`` on a machine
with 4 or more GPUs, NCCL with one GPU per rank (with fewer GPUs that part is skipped, saying so).

1. **Memory** (``--mem-*``, default ``gpt_small``: 12 layers x d=768, 12 heads, vocab 50,304,
   max_seq_len 1024; tied embeddings), each engine in fresh spawned processes, ``--mem-steps``
   training steps of one row of ``--mem-seq`` tokens per DP rank. Per rank: the bytes held in
   parameters, gradients and AdamW state after the steps, counted as the storages of the tensors
   actually held (a DTensor's local tensor: FSDP's padded shard; DDP's gradients: views of its
   buckets; each storage once), FSDP / DDP -- the issue's bar is <= 0.55; the peak of live tensor
   bytes within a step (`bigdense.plan.measure`; on a GPU the allocator's peak); and the peak
   resident set (``VmHWM``; on a GPU ``max_memory_allocated``) over the whole process and over the
   steps after the first.
2. **Collectives per step** (``--d``, ``--layers``, ...; a GPT d=256 x 4 layers, vocab 8,192,
   sequence 256, global batch 8) at ``grad_accum`` 1 and 2, counted with
   `bigdense.testing.counters.CollectiveCounter` (a dispatch mode that sees every ``c10d``
   operator, from Python or C++: DDP's bucket all-reduces come from its C++ reducer) in a step after
   two warm-up steps (DDP rebuilds its buckets in the second): FSDP's all-gathers and
   reduce-scatters over DP next to DDP's all-reduces, with what they should be from the model (FSDP
   units x gathers, padded parameter bytes; DDP: every gradient byte once), and bigdense's own TP,
   DP and world collectives (also counted by `bigdense.count_collectives`, which must agree).
   Bytes are the full size of each collective (what an all-gather produces, what a reduce-scatter
   consumes), not what the backend's algorithm sends.
3. **Step time**, FSDP / DDP, the same GPT at ``grad_accum`` 1, steps of the two engines
   alternating in the same processes (the slowest rank's ``train_step``, median of ``--iters``
   after 2 warm-up steps). For reading only, never for asserting.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from . import SEED, append_json_lines, peak_rss_bytes

GPT_SMALL = dict(d=768, layers=12, heads=12, vocab=50304, max_seq=1024)
ENGINES = ("ddp", "fsdp")
TP = 2
WORLD = 4


# ---- building --------------------------------------------------------------------------------
def _context(device: str):
    import bigdense as bd

    ctx = bd.init_parallel(tp=TP, backend="nccl" if device == "cuda" else "gloo")
    if ctx.dp_size * ctx.tp_size != WORLD:
        raise RuntimeError(f"bench.fsdp runs on {WORLD} ranks (tp={TP} x dp=2), got {ctx.tp_size} x {ctx.dp_size}")
    return ctx


def _gpt(ctx, d, layers, heads, vocab, max_seq):
    from bigdense.models import GPT, GPTConfig

    torch.manual_seed(SEED)
    cfg = GPTConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, max_seq_len=max_seq,
                    head_chunk_size=4096)
    with torch.device(ctx.device):
        return GPT(cfg, tp_group=ctx.tp_group)


def _engine(model, ctx, kind, micro_batch, accum):
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    return bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=kind), optim_cfg=OptimConfig(warmup_steps=1),
                           precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=micro_batch,
                           grad_accum=accum, max_steps=10**6)


def _micro_batches(ctx, step, global_batch, seq, vocab, accum):
    """This DP rank's rows of each of the step's ``accum`` global micro-batches."""
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g).to(ctx.device)
    per_micro = global_batch // accum
    local = per_micro // ctx.dp_size
    out = []
    for a in range(accum):
        rows = tokens[a * per_micro:(a + 1) * per_micro][ctx.dp_rank * local:(ctx.dp_rank + 1) * local]
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def _sync(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


# ---- what the engines hold and should move ------------------------------------------------------
def held_bytes(engine) -> dict:
    """Bytes of the storages behind this rank's parameters, gradients and optimizer state (a
    DTensor's local tensor; each storage counted once, in the first category that reaches it)."""
    from bigdense.parallel.sharding import local_tensor

    seen: set = set()

    def total(tensors) -> int:
        out = 0
        for t in tensors:
            storage = local_tensor(t).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out += storage.nbytes()
        return out

    params = list(engine.model.parameters())
    counts = {"params": total(params), "grads": total(p.grad for p in params if p.grad is not None),
              "optim": total(v for state in engine.optimizer.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor))}
    counts["total"] = sum(counts.values())
    return counts


def expected_collectives(engine) -> dict:
    """What the DP engine should move per micro-batch/step, from the model as sharded.

    FSDP: its units with trainable parameters, how many reshard after forward (each such unit is
    all-gathered again for its backward), their parameters' bytes as FSDP pads them (dim 0 to a
    multiple of the DP size) and unpadded; DDP: the bytes of the gradients it reduces (every
    trainable parameter's TP-local tensor)."""
    from bigdense.parallel.sharding import local_tensor

    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    local_bytes = sum(local_tensor(p).numel() * p.element_size() for p in trainable)
    if engine.kind != "fsdp":
        return {"grad_bytes": local_bytes}
    from torch.distributed.fsdp import FSDPModule

    groups = {}
    for module in engine.model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                if any(fp.sharded_param.requires_grad for fp in group.fsdp_params):
                    groups[id(group)] = group
    units, dp = list(groups.values()), engine.ctx.dp_size
    unit_bytes = [sum(fp.padded_sharded_param_size.numel() * dp * fp.sharded_param.element_size()
                      for fp in g.fsdp_params) for g in units]
    resharded = [g._reshard_after_forward for g in units]
    return {
        "units": len(units), "units_resharded_after_forward": sum(resharded),
        "padded_param_bytes": sum(unit_bytes),
        # per micro-batch: one gather before each unit's forward, one more before the backward of
        # each unit resharded after forward
        "gather_bytes_per_micro_batch": sum(b * (1 + r) for b, r in zip(unit_bytes, resharded)),
        "gathers_per_micro_batch": len(units) + sum(resharded),
        # TP-local parameters gathered whole, across DP: the unpadded figure
        "param_bytes": sum(p.numel() * p.element_size() for p in map(_tp_local_full, trainable)),
    }


def _tp_local_full(p):
    """An FSDP parameter's TP-local tensor shape (the DTensor's global shape over the DP mesh)."""
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def count_step(engine, ctx, batches) -> dict:
    """One ``train_step`` under `CollectiveCounter` and `bd.count_collectives`: ``{"by": {"kind group
    origin": [calls, bytes]}, "bigdense": {kind: [calls, bytes]}}``."""
    import bigdense as bd
    from bigdense.testing.counters import CollectiveCounter

    with CollectiveCounter({"tp": ctx.tp_group, "dp": ctx.dp_group}) as counter, bd.count_collectives() as ours:
        engine.train_step(batches)
    _sync(ctx)
    return {"by": {" ".join(key): list(value) for key, value in sorted(counter.summary().items())},
            "bigdense": {kind: list(value) for kind, value in sorted(ours.by_kind.items())}}


def _peak(ctx) -> int:
    """Peak memory so far (since the last `_reset_peak`): allocated on GPU, resident on CPU."""
    return torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else peak_rss_bytes()


def _reset_peak(ctx) -> bool:
    """Restart the peak: the CUDA allocator's statistic, or on Linux the process's ``VmHWM``
    (``5`` written to ``/proc/self/clear_refs``); False where that cannot be done."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---- 1. memory -------------------------------------------------------------------------------
def memory_rank(kind, shape: dict, seq: int, steps: int = 3, device: str = "cpu") -> dict:
    """One rank of engine ``kind`` on the GPT ``shape`` (keys of `GPT_SMALL`): ``steps`` training
    steps of one row of ``seq`` tokens per DP rank, then what it holds (`held_bytes`) and its peak
    memory: ``peak_bytes``, resident (``VmHWM``: the whole process from its start, build
    included) or on GPU allocated; ``peak_bytes_after_first_step``, the same restarted after the
    first step (whose optimizer step creates the AdamW state, and under FSDP runs DTensor's
    one-time sharding propagation); ``step_peak_live_bytes``, the peak of live tensor bytes within
    a step after the first (`bigdense.plan.measure`: what ``max_memory_allocated`` says on a GPU;
    the least over those steps, as gloo's threads may drop a buffer late)."""
    import bigdense as bd
    from bigdense.plan.measure import measure_step_peak

    torch.set_num_threads(1)
    ctx = _context(device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model = _gpt(ctx, **shape)
    engine = _engine(model, ctx, kind, micro_batch=1, accum=1)
    live = []
    with bd.set_checks(False):
        for step in range(steps):
            batches = _micro_batches(ctx, step, ctx.dp_size, seq, shape["vocab"], 1)
            if step == 0:
                result = engine.train_step(batches)
                _sync(ctx)
                first_peak = _peak(ctx)
                reset = _reset_peak(ctx)
            else:
                def one(batches=batches):
                    nonlocal result
                    result = engine.train_step(batches)
                live.append(measure_step_peak(one, engine.model, engine.optimizer, ctx.device)["peak_bytes"])
    _sync(ctx)
    later = _peak(ctx) if reset and steps > 1 else None
    return {"held": held_bytes(engine), "peak_bytes": max(first_peak, later or 0), "peak_bytes_after_first_step": later,
            "step_peak_live_bytes": min(live) if live else None,
            "loss": float(result.loss),
            "params_tp_local": sum(p.numel() for p in map(_tp_local_full, model.parameters()))}


# ---- 2. and 3. collectives and step time ---------------------------------------------------------
def comm_rank(shape: dict, seq: int, global_batch: int, accums=(1, 2), warmup: int = 2, iters: int = 0,
              device: str = "cpu") -> dict:
    """Per engine and ``grad_accum``: the collectives of one step after ``warmup`` steps
    (`count_step`) and what they should be (`expected_collectives`); with ``iters`` > 0, the step
    times at ``grad_accum`` 1, the engines alternating step by step (slowest rank, seconds)."""
    import bigdense as bd

    torch.set_num_threads(1)
    ctx = _context(device)
    engines = {}
    for accum in accums:
        for kind in ENGINES:
            model = _gpt(ctx, **shape)
            engines[kind, accum] = _engine(model, ctx, kind, global_batch // accum // ctx.dp_size, accum)
    times = {kind: [] for kind in ENGINES}
    out = {}
    with bd.set_checks(False):
        for (kind, accum), engine in engines.items():
            for step in range(warmup):
                engine.train_step(_micro_batches(ctx, step, global_batch, seq, shape["vocab"], accum))
        for it in range(iters):
            for kind in ENGINES:
                batches = _micro_batches(ctx, warmup + it, global_batch, seq, shape["vocab"], 1)
                _sync(ctx)
                dist.barrier()
                start = time.perf_counter()
                engines[kind, 1].train_step(batches)
                _sync(ctx)
                slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[kind].append(float(slowest))
        for (kind, accum), engine in engines.items():
            counted = count_step(engine, ctx, _micro_batches(ctx, 10**4, global_batch, seq, shape["vocab"], accum))
            out[f"{kind} accum={accum}"] = {**counted, "expected": expected_collectives(engine)}
    return {"counts": out, "times_s": times}


# ---- reporting -------------------------------------------------------------------------------
def _calls_bytes(counted: dict, kind: str, group: str, origin: str | None = None) -> tuple[int, int]:
    calls = total = 0
    for key, (c, b) in counted["by"].items():
        k, g, o = key.split(" ")
        if k == kind and g == group and (origin is None or o == origin):
            calls, total = calls + c, total + b
    return calls, total


def dp_engine_collectives(counted: dict, kind: str) -> dict:
    """The DP engine's own collectives in a counted step: FSDP's all-gathers and reduce-scatters,
    DDP's all-reduces (issued by its reducer: not bigdense's, over DP); ``[calls, bytes]`` each."""
    if kind == "fsdp":
        return {"all_gather": list(_calls_bytes(counted, "all_gather", "dp", "fsdp")),
                "reduce_scatter": list(_calls_bytes(counted, "reduce_scatter", "dp", "fsdp"))}
    ddp = [0, 0]
    for origin in ("other", "ddp"):
        calls, total = _calls_bytes(counted, "all_reduce", "dp", origin)
        ddp = [ddp[0] + calls, ddp[1] + total]
    return {"all_reduce": ddp}


def bigdense_collectives(counted: dict, by: str = "group") -> dict:
    """bigdense's own collectives by group (``{"tp": [calls, bytes], "dp": ..., "world": ...}``) or,
    with ``by="kind"``, by kind (``{"all_reduce": [calls, bytes], ...}``)."""
    out = {}
    for key, (c, b) in counted["by"].items():
        kind, group, origin = key.split(" ")
        if origin == "bigdense":
            name = group if by == "group" else kind
            calls, total = out.get(name, (0, 0))
            out[name] = [calls + c, total + b]
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def run_memory(args, spawn, device, rows):
    shape = dict(d=args.mem_d, layers=args.mem_layers, heads=args.mem_heads, vocab=args.mem_vocab,
                 max_seq=args.mem_max_seq)
    peak_name = "RSS" if device == "cpu" else "allocated"
    print(f"1. memory: GPT d={shape['d']} x {shape['layers']} layers, {shape['heads']} heads, vocab {shape['vocab']:,}, "
          f"max_seq_len {shape['max_seq']} (tied embeddings), fp32 + AdamW, tp={TP} x dp=2 on {device}; "
          f"{args.mem_steps} steps of 1 x {args.mem_seq} tokens per DP rank; the largest rank's figures")
    res = {kind: spawn(memory_rank, kind, shape, args.mem_seq, args.mem_steps, device) for kind in ENGINES}
    keys = ("peak_bytes", "peak_bytes_after_first_step", "step_peak_live_bytes")

    def worst(kind, key):
        values = [r["held"]["total"] if key == "held" else r[key] for r in res[kind]]
        return None if None in values else max(values)

    def ratio(kind, key):
        value, base = worst(kind, key), worst("ddp", key)
        return None if value is None or not base else value / base

    def fmt(value, r):
        return "n/a" if value is None else f"{value / 2**20:,.0f} MiB ({r:.3f}x)"

    for kind in ENGINES:
        held = [r["held"] for r in res[kind]]
        parts = max(held, key=lambda h: h["total"])
        print(f"   {kind:<5} params + grads + AdamW {_mib(parts['total']):>11} (params {_mib(parts['params'])}, "
              f"grads {_mib(parts['grads'])}, AdamW {_mib(parts['optim'])}) {ratio(kind, 'held'):.3f}x DDP;  "
              f"step's live peak {fmt(worst(kind, 'step_peak_live_bytes'), ratio(kind, 'step_peak_live_bytes'))};  "
              f"peak {peak_name} {fmt(worst(kind, 'peak_bytes'), ratio(kind, 'peak_bytes'))}, after the first step "
              f"{fmt(worst(kind, 'peak_bytes_after_first_step'), ratio(kind, 'peak_bytes_after_first_step'))};  "
              f"loss {res[kind][0]['loss']:.4f}", flush=True)
        rows.append(dict(bench="fsdp", metric="memory", device=device, engine=kind, **shape, seq=args.mem_seq,
                         steps=args.mem_steps, held_bytes_per_rank=[h["total"] for h in held], held_parts_max_rank=parts,
                         held_ratio_vs_ddp=ratio(kind, "held"),
                         **{f"{key}_per_rank": [r[key] for r in res[kind]] for key in keys},
                         **{f"{key}_ratio_vs_ddp": ratio(kind, key) for key in keys}, loss=res[kind][0]["loss"]))
    print(f"   FSDP / DDP, parameters + gradients + AdamW per rank = {ratio('fsdp', 'held'):.3f} (the issue's bar: "
          f"<= 0.55); TP-local parameters per rank: {res['ddp'][0]['params_tp_local']:,}")
    return ratio("fsdp", "held")


def run_comm(args, spawn, device, rows):
    shape = dict(d=args.d, layers=args.layers, heads=args.heads, vocab=args.vocab, max_seq=args.seq)
    print(f"2. collectives per step: GPT d={args.d} x {args.layers} layers, {args.heads} heads, vocab {args.vocab:,}, "
          f"seq {args.seq}, global batch {args.batch}, fp32, tp={TP} x dp=2 on {device}; rank 0, one step after 2 warm-up")
    per_rank = spawn(comm_rank, shape, args.seq, args.batch, (1, 2), 2, args.iters, device)
    res = per_rank[0]
    for label, counted in res["counts"].items():
        kind, accum = label.split(" ")[0], int(label.split("=")[1])
        exp = counted["expected"]
        dp = dp_engine_collectives(counted, kind)
        ours = bigdense_collectives(counted)
        if kind == "fsdp":
            (ag, ag_b), (rs, rs_b) = dp["all_gather"], dp["reduce_scatter"]
            print(f"   fsdp accum={accum}: all-gathers {ag} ({_mb(ag_b)}; expected {accum} x "
                  f"{exp['gathers_per_micro_batch']} = {accum * exp['gathers_per_micro_batch']}, "
                  f"{_mb(accum * exp['gather_bytes_per_micro_batch'])}), reduce-scatters {rs} ({_mb(rs_b)}; "
                  f"{exp['units']} units, {_mb(exp['padded_param_bytes'])} of padded gradients)")
        else:
            ar, ar_b = dp["all_reduce"]
            print(f"   ddp  accum={accum}: bucket all-reduces {ar} ({_mb(ar_b)}; every gradient once: {_mb(exp['grad_bytes'])})")
        print(f"              bigdense's own: " + ", ".join(f"{g} {c} calls {b:,} B" for g, (c, b) in sorted(ours.items())))
        rows.append(dict(bench="fsdp", metric="collectives_per_step", device=device, engine=kind, grad_accum=accum,
                         **shape, global_batch=args.batch, dp_engine=dp, bigdense=ours, expected=exp,
                         all=counted["by"]))
    if args.iters:
        med = {kind: statistics.median(ts) * 1e3 for kind, ts in res["times_s"].items()}
        print(f"3. step time, same GPT, grad_accum 1, engines alternating, slowest rank, median of {args.iters} "
              f"after 2 warm-up: ddp {med['ddp']:.1f} ms   fsdp {med['fsdp']:.1f} ms   FSDP / DDP {med['fsdp'] / med['ddp']:.2f}")
        rows.append(dict(bench="fsdp", metric="step_time_ms", device=device, **shape, global_batch=args.batch,
                         ddp=med["ddp"], fsdp=med["fsdp"], ratio=med["fsdp"] / med["ddp"], times_s=res["times_s"]))
    return res


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mem-d", type=int, default=GPT_SMALL["d"])
    parser.add_argument("--mem-layers", type=int, default=GPT_SMALL["layers"])
    parser.add_argument("--mem-heads", type=int, default=GPT_SMALL["heads"])
    parser.add_argument("--mem-vocab", type=int, default=GPT_SMALL["vocab"])
    parser.add_argument("--mem-max-seq", type=int, default=GPT_SMALL["max_seq"])
    parser.add_argument("--mem-seq", type=int, default=64, help="tokens per row in the memory run's steps")
    parser.add_argument("--mem-steps", type=int, default=3, help="the first unmeasured, the others' least live peak")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows), split over DP and grad_accum")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per engine")
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both",
                        help="cpu: gloo; cuda: NCCL on 4 GPUs; both (default): cpu, then cuda where 4 GPUs exist")
    parser.add_argument("--quick", action="store_true", help="small models, 3 timed steps")
    parser.add_argument("--json", help="append one JSON object per result to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.mem_d, args.mem_layers, args.mem_heads, args.mem_vocab, args.mem_max_seq = 256, 4, 4, 8192, 256
        args.mem_seq, args.d, args.layers, args.vocab, args.seq, args.iters = 32, 64, 2, 1024, 64, 3

    from bigdense.bench import fsdp as this  # importable by name in spawned processes
    from bigdense.testing import run_ranks

    rows: list = []
    devices = ["cpu"] if args.device in ("cpu", "both") else []
    if args.device in ("cuda", "both"):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= WORLD:
            devices.append("cuda")
        else:
            print(f"GPU part skipped: it needs {WORLD} CUDA devices (tp={TP} x dp=2, NCCL), this machine has {gpus}")
    for device in devices:
        def spawn(fn, *fn_args):
            return run_ranks(getattr(this, fn.__name__), WORLD, *fn_args, start_method="spawn", timeout=3600,
                             collective_timeout=1800, init_process_group=device == "cpu")

        print(f"== {device}: {'gloo CPU processes x 1 thread' if device == 'cpu' else 'NCCL, one GPU per rank'}")
        run_memory(args, spawn, device, rows)
        run_comm(args, spawn, device, rows)
    if args.json:
        append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
