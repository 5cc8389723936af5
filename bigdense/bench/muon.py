"""Muon's two exchange schemes (``optim.muon_comm``): bytes, collectives, optimizer-step time; the planner at 1B.

    python -m bigdense.bench.muon                     # gpt_small's shape, DDP and FSDP, tp=2 x dp=2: ~5 min, 2 cores
    python -m bigdense.bench.muon --quick --json muon.jsonl

1. **Measured** at tp=2 x dp=2 on 4 gloo CPU processes x 1 thread, each engine of ``--engines`` (DDP,
   FSDP) in turn: the reference GPT at ``conf/model/gpt_small.yaml``'s shape (12 layers, d=768, 12
   heads, MLP 3,072, tied embedding, vocabulary 50,304; ``--quick``: 2 layers, d=60, MLP 240,
   vocabulary 301), fp32, Muon (``optim.name=muon``, built by ``bd.build_engine``; the Newton-Schulz
   dtype on CPU is fp32). One ``train_step`` (one row of ``--seq`` tokens per DP rank) makes the
   gradients and the optimizer state; then ``engine.optimizer.step()`` alone -- Muon's step and
   AdamW's for the other parameters -- is timed ``--iters`` times per scheme on those same gradients,
   the schemes alternating step by step: the scheme is the optimizer's `Exchange`, rebuilt over the
   same matrices (weights and momentum move on from step to step; the work does not change). Per
   scheme: the bytes each rank sends in the first timed step and its all-to-alls, counted by
   ``bd.count_collectives`` (beside them the planner's figure for the same model and layout,
   `bigdense.plan.muon`); the step's time (the slowest rank, median); each rank's Newton-Schulz
   GFLOPs (`Exchange.assignment.work`) and the time of its Newton-Schulz alone (its own matrices,
   random values of their shapes, back to back, every rank at once); and gather / all_to_all. Four
   processes share 2 cores, so every time includes waiting for a core, alike for both schemes.
2. **Planned** (`bigdense.plan`, no process): ``gpt_1b`` of `bigdense.bench.gpu` (d=2048, 18 layers,
   16 heads, vocabulary 50,304, 8 x 1024 tokens) in bf16 on CUDA at tp=8 x dp=8 and tp=2 x dp=2,
   DDP and FSDP: the bytes each rank sends per step for both schemes, the collectives, the
   Newton-Schulz FLOPs per rank, and a modelled time (`bigdense.plan.muon.muon_time`: the busiest
   rank's FLOPs at ``--tflops``, the most any rank sends at ``--gbps``, ``--latency-us`` per
   collective, nothing overlapped; the defaults are the planner's, `bigdense.config.PlanConfig`).

``--json`` appends one object per result: ``part`` "measured" (``engine``, ``scheme``,
``sent_bytes`` and ``planned_sent_bytes`` per rank, ``all_to_alls``, ``step_s`` (per iteration),
``step_ms`` (median), ``ns_gflops`` and ``ns_s`` per rank, ``gather_over_all_to_all``) or
"planned" (``layout``, ``engine``, ``scheme``, ``sent_bytes_max``, ``collectives``,
``ns_flops_max``, ``modelled_ms`` and the assumptions). Times are for reading, never for asserting.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import SEED, append_json_lines

GPT_SMALL = dict(d=768, layers=12, heads=12, vocab=50304, max_seq=1024)
QUICK = dict(d=60, layers=2, heads=6, vocab=301, max_seq=32)
ENGINES = ("ddp", "fsdp")
SCHEMES = ("all_to_all", "gather")
TP, WORLD = 2, 4
PLANNED_LAYOUTS = ((8, 8), (2, 2))  # (tp, dp) of the 1B rows


# ---- building --------------------------------------------------------------------------------
def _gpt_config(shape: dict):
    from ..models import GPTConfig

    return GPTConfig(vocab_size=shape["vocab"], d_model=shape["d"], n_layers=shape["layers"], n_heads=shape["heads"],
                     max_seq_len=shape["max_seq"], head_chunk_size=4096)


def _engine(ctx, kind: str, shape: dict):
    import bigdense as bd
    from ..config import EngineConfig, OptimConfig, PrecisionConfig
    from ..models import GPT

    torch.manual_seed(SEED)
    with torch.device(ctx.device):
        model = GPT(_gpt_config(shape), tp_group=ctx.tp_group)
    return bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=kind),
                           optim_cfg=OptimConfig(name="muon", warmup_steps=1),
                           precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=1, max_steps=10**6)


def _use_scheme(optimizer, scheme: str) -> None:
    """Make ``optimizer`` move its matrices by ``scheme``: its `Exchange` rebuilt over the same matrices."""
    from ..muon import Exchange, ns_flops

    ex = optimizer.exchange
    steps = max(int(g["ns_steps"]) for g in optimizer.param_groups if g["muon"])
    optimizer.exchange = Exchange(ex.matrices, [ns_flops(m.shape, steps) for m in ex.matrices], ex.layout,
                                  ex.rank, ex.group, scheme)


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    """``fn()``'s time on the slowest rank, every rank starting together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def _ns_alone(optimizer) -> float:
    """Seconds this rank's Newton-Schulz takes on its own matrices (random values), back to back."""
    import torch.distributed as dist

    from ..muon import orthogonalize

    ex, group = optimizer.exchange, next(g for g in optimizer.param_groups if g["muon"])
    g = torch.Generator().manual_seed(SEED + ex.rank)
    wholes = [torch.randn(ex.matrices[m].shape, generator=g).to(optimizer.ns_dtype)
              for m in ex.assignment.owned_by(ex.rank)]
    dist.barrier()
    start = time.perf_counter()
    for whole in wholes:
        orthogonalize(whole, group["ns_coefficients"], int(group["ns_steps"]), float(group["ns_eps"]),
                      optimizer.ns_dtype)
    return time.perf_counter() - start


def measure_rank(kind: str, shape: dict, seq: int, iters: int) -> dict:
    """One rank of engine ``kind``: per scheme the counted bytes and all-to-alls of an optimizer
    step, the step's times (slowest rank), and this rank's Newton-Schulz FLOPs and time alone."""
    import bigdense as bd

    torch.set_num_threads(1)
    ctx = bd.init_parallel(tp=TP)
    engine = _engine(ctx, kind, shape)
    g = torch.Generator().manual_seed(SEED + ctx.dp_rank)
    tokens = torch.randint(0, shape["vocab"], (1, seq + 1), generator=g)
    with bd.set_checks(False):
        engine.train_step([(tokens[:, :-1], tokens[:, 1:])])  # the gradients and the optimizer state
        opt, out = engine.optimizer, {s: {"step_s": []} for s in SCHEMES}
        for it in range(iters):
            for scheme in SCHEMES:
                _use_scheme(opt, scheme)
                with bd.count_collectives() as counts:
                    out[scheme]["step_s"].append(_timed(opt.step))
                if it == 0:  # (every step moves the same)
                    out[scheme].update(sent_bytes=counts.bytes("all_to_all"), all_to_alls=counts.calls("all_to_all"),
                                       ns_flops=opt.exchange.assignment.work[ctx.rank])
        ns_s = _ns_alone(opt)
    for scheme in SCHEMES:
        out[scheme]["ns_s"] = ns_s  # the same matrices on the same owner, whatever moves them
    return out


# ---- the planner -----------------------------------------------------------------------------
def planned(shape: dict, tp: int, dp: int, engine: str, precision: str, device_type: str, seq: int = 0,
            batch: int = 1) -> dict:
    """``{scheme: MuonPlan}`` of the GPT ``shape`` at ``tp`` x ``dp`` (`bigdense.plan.estimate`)."""
    from ..models import GPT
    from ..plan import estimate
    from ..plan.muon import MuonSettings

    with torch.device("meta"):
        model = GPT(_gpt_config(shape))
    return {s: estimate(model, tp=tp, dp=dp, engine=engine, precision=precision, device_type=device_type,
                        micro_batch_size=batch, seq_len=seq or None, muon=MuonSettings(scheme=s)).muon
            for s in SCHEMES}


# ---- the two parts ---------------------------------------------------------------------------
def run_measured(args, shape: dict, rows: list) -> None:
    from ..testing import run_ranks

    print(f"1. measured: GPT d={shape['d']} x {shape['layers']} layers, {shape['heads']} heads, "
          f"vocab {shape['vocab']:,}, fp32, Muon (Newton-Schulz in fp32), tp={TP} x dp=2 on 4 gloo CPU processes "
          f"x 1 thread (2 cores); "
          f"optimizer.step() on one step's gradients, slowest rank, median of {args.iters}")
    for kind in args.engines:
        per_rank = run_ranks(measure_rank, WORLD, kind, shape, args.seq, args.iters, timeout=3600,
                             collective_timeout=1800)
        plans = planned(shape, TP, 2, kind, "fp32", "cpu")
        medians = {s: statistics.median(per_rank[0][s]["step_s"]) for s in SCHEMES}
        for scheme in SCHEMES:
            got = [r[scheme] for r in per_rank]
            row = dict(bench="muon", part="measured", engine=kind, scheme=scheme, **shape, tp=TP, dp=2,
                       sent_bytes=[r["sent_bytes"] for r in got], planned_sent_bytes=plans[scheme].sent_bytes,
                       all_to_alls=[r["all_to_alls"] for r in got], step_s=got[0]["step_s"],
                       step_ms=medians[scheme] * 1e3, ns_gflops=[r["ns_flops"] / 1e9 for r in got],
                       ns_s=[r["ns_s"] for r in got], gather_over_all_to_all=medians["gather"] / medians["all_to_all"])
            rows.append(row)
            print(f"   {kind:<4} {scheme:<10}  sent per rank {_mib_list(row['sent_bytes'])} (planner: "
                  f"{_mib_list(row['planned_sent_bytes'])}), {row['all_to_alls'][0]} all-to-alls;  optimizer step "
                  f"{row['step_ms']:8.1f} ms;  Newton-Schulz {_list(row['ns_gflops'], '{:.3g}')} GFLOP, alone "
                  f"{_list([s * 1e3 for s in row['ns_s']], '{:.0f}')} ms", flush=True)
        print(f"   {kind:<4} gather / all_to_all: {medians['gather'] / medians['all_to_all']:.3f}")


def run_planned(args, rows: list) -> None:
    from ..plan.muon import muon_time
    from .gpu import MODELS

    spec = MODELS["gpt_1b"]
    shape = dict(d=spec["d_model"], layers=spec["n_layers"], heads=spec["n_heads"], vocab=spec["vocab_size"],
                 max_seq=spec["seq"])
    print(f"2. planned (bigdense.plan): gpt_1b, d={shape['d']} x {shape['layers']} layers, {shape['heads']} heads, "
          f"vocab {shape['vocab']:,}, {spec['batch']} x {spec['seq']} tokens, bf16 on CUDA (Newton-Schulz and the "
          f"exchange in bf16); modelled Muon time = busiest rank's Newton-Schulz FLOPs at {args.tflops:g} TFLOP/s + "
          f"most bytes any rank sends at {args.gbps:g} GB/s + {args.latency_us:g} us per collective, "
          f"nothing overlapped")
    for tp, dp in PLANNED_LAYOUTS:
        for engine in ENGINES:
            plans = planned(shape, tp, dp, engine, "bf16", "cuda", spec["seq"], spec["batch"])
            for scheme, plan in plans.items():
                modelled = muon_time(plan, args.tflops, args.gbps, args.latency_us)
                rows.append(dict(bench="muon", part="planned", model="gpt_1b", layout=f"tp={tp} x dp={dp}", tp=tp,
                                 dp=dp, engine=engine, scheme=scheme, sent_bytes_max=plan.busiest("sent_bytes"),
                                 sent_bytes_min=min(plan.sent_bytes), collectives=plan.collectives[scheme],
                                 matrices=plan.matrices, rounds=plan.rounds, ns_flops_max=plan.busiest("ns_flops"),
                                 ns_flops_min=min(plan.ns_flops), step_bytes_max=plan.busiest("step_bytes"),
                                 modelled_ms=modelled * 1e3, tflops=args.tflops, gbps=args.gbps,
                                 latency_us=args.latency_us))
                print(f"   tp={tp} x dp={dp} {engine:<4} {scheme:<10}  sent per rank "
                      f"{min(plan.sent_bytes) / 2**20:8.1f}-"
                      f"{plan.busiest('sent_bytes') / 2**20:8.1f} MiB, {plan.collectives[scheme]:4d} all-to-alls, "
                      f"Newton-Schulz {min(plan.ns_flops) / 1e12:.2f}-{plan.busiest('ns_flops') / 1e12:.2f} TFLOP per "
                      f"rank ({plan.matrices} matrices, {plan.rounds} rounds); modelled {modelled * 1e3:7.2f} ms")


def _mib_list(values) -> str:
    return _list([v / 2**20 for v in values], "{:.2f}") + " MiB"


def _list(values, fmt: str) -> str:
    return "/".join(fmt.format(v) for v in values)


def main(argv=None) -> int:
    from ..config import PlanConfig

    plan = PlanConfig()
    parser = argparse.ArgumentParser(prog="python -m bigdense.bench.muon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT for the measured part (seconds)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--seq", type=int, default=64, help="tokens of the one training step that makes the gradients")
    parser.add_argument("--iters", type=int, default=3, help="timed optimizer steps per scheme")
    parser.add_argument("--tflops", type=float, default=plan.tflops, help="the modelled GEMM rate (bf16), TFLOP/s")
    parser.add_argument("--gbps", type=float, default=plan.dp_gbps, help="the modelled link bandwidth, GB/s")
    parser.add_argument("--latency-us", type=float, default=plan.latency_us, help="the modelled cost of a collective")
    parser.add_argument("--json", help="append one JSON object per result to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.iters = 16, 2
    rows: list = []
    run_measured(args, QUICK if args.quick else GPT_SMALL, rows)
    run_planned(args, rows)
    if args.json:
        append_json_lines(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
