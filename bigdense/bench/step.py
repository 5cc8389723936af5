"""What a GPU would pay per training step, measured on CPU: kernels, host syncs, and step time.

    python -m bigdense.bench.step                 # gpt_small op counts + a tp=2 timed GPT, ~3 min on 2 cores
    python -m bigdense.bench.step --quick --json step.jsonl
    python -m bigdense.bench.step --compile model --backend inductor   # eager against trainer.compile=model
    python -m bigdense.bench.step --lora 16       # the same with LoRA adapters on every projection, the base frozen
    python -m bigdense.bench.step --optim muon    # the same with Muon on the dense weights (AdamW for the rest)

Three measurements, each of the tile-loop dropout bigdense used to have (``baseline``, kept here
verbatim as `tiled_dropout`, with host-side checks on as they then always were) against the
current code (counter-based `bd.tp_dropout`, checks off as in the training loop's hot path), in
the same run:

1. **Kernels per step** of ``gpt_small`` (12 x 768, 12 heads, vocab 50,304, batch 8, sequence
   1024, dropout 0.1 on embeddings, attention probabilities and outputs, MLP outputs), TP rank 0
   of tp=2: every aten op of forward, backward, clipping and the AdamW step, counted with a
   dispatch mode (`bigdense.testing.counters.OpCounter`; views launch nothing and are left out). Shapes
   only: the model lives on the meta device and the TP collectives go to a fake process group,
   so nothing is computed (the baseline's per-tile generators, which meta tensors cannot have,
   are left out: seeding a generator is not an op; host checks are off in both, as meta tensors
   cannot be read). Also at sequence 256, to show what grows.
2. **Host syncs per step** (`aten._local_scalar_dense`, ``nonzero``, ``tolist`` ...), counted in
   the timed run below.
3. **Step time** of a smaller GPT (``--d``, ``--layers``, ``--seq``; dropout 0.1 everywhere, fp32)
   at tp=2 on two gloo CPU processes x 1 thread, through the DDP engine's ``train_step``; the
   two variants alternate step by step so machine noise hits both alike; median.

With ``--compile blocks|model`` (``trainer.compile``'s modes; ``--backend``, default ``aot_eager``,
which traces forward and backward as inductor does without a C++ compiler) the timed comparison is
instead the current code eager against the same model compiled, and the compiled run reports the
graphs its first step compiled -- ``graphs_forward`` (Dynamo's), ``graphs_backward``
(AOTAutograd's) -- and the ``graph_breaks`` it took (`bigdense.train.compile.GraphCounts`), beside
the eager step's aten ops and host syncs and the compiled graphs' ``kernels``
(`bigdense.train.compile_counts`: inductor's generated kernels plus the aten ops it leaves, or
aot_eager's aten ops; a dispatch-mode count cannot see inside compiled code). Every count is the
same run after run on one machine; inductor's also depends on the vector instructions it generates
its C++ kernels for, the CPU's widest (``vec_isa``, printed with the count;
``ATEN_CPU_CAPABILITY=default``: none), so two machines' counts compare only at the same
``vec_isa`` (docs/performance.md).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch

from . import append_json_lines
from ..testing.counters import OpCounter

GPT_SMALL = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, max_seq_len=1024, head_chunk_size=4096)


def tiled_dropout(x, p, training=True, *, shard_dim=None, global_size=None, offset=0):
    """The baseline: bigdense's former `tp_dropout`, which drew each mask tile by tile (fixed tiles
    of ~256K draws of the global tensor, each from its own seeded generator) from a seed read on
    the host. Same masks at every layout, but the number of ops grows with the tensor."""
    from bigdense.parallel.dropout import current_batch_slice
    from bigdense.parallel.random import draw_seed, mix_seed

    if not training or p == 0.0:
        return x
    seed = draw_seed()
    shape = list(x.shape)
    if shard_dim is None:
        rows, cols, col_offset = math.prod(shape[:-1]), shape[-1], 0
    else:
        shard_dim %= x.dim()
        inner = math.prod(shape[shard_dim + 1 :])
        rows, cols, col_offset = math.prod(shape[:shard_dim]), global_size * inner, offset * inner
    row_offset, global_rows = 0, rows
    if current_batch_slice() is not None:
        start, total = current_batch_slice()
        row_offset, global_rows = start * (rows // shape[0]), total * (rows // shape[0])
    tile_cols = min(cols, 8192)
    tile_rows = max(1, (1 << 18) // tile_cols)
    mask = torch.empty((rows, x.numel() // rows), dtype=torch.float32, device=x.device)
    generator = None if x.device.type == "meta" else torch.Generator(device=x.device)
    r0, c0 = row_offset, col_offset
    r1, c1 = r0 + mask.shape[0], c0 + mask.shape[1]
    with torch.no_grad():
        for ti in range(r0 // tile_rows, -(-r1 // tile_rows)):
            tr0, tr1 = ti * tile_rows, min((ti + 1) * tile_rows, global_rows)
            for tj in range(c0 // tile_cols, -(-c1 // tile_cols)):
                tc0, tc1 = tj * tile_cols, min((tj + 1) * tile_cols, cols)
                if generator is not None:
                    generator.manual_seed(mix_seed(seed, ti, tj))
                block = torch.empty(tr1 - tr0, tc1 - tc0, dtype=torch.float32, device=x.device)
                block.bernoulli_(1.0 - p, generator=generator)
                a0, a1, b0, b1 = max(tr0, r0), min(tr1, r1), max(tc0, c0), min(tc1, c1)
                mask[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0].copy_(block[a0 - tr0 : a1 - tr0, b0 - tc0 : b1 - tc0])
    return x * mask.bool().view_as(x) * (1.0 / (1.0 - p))


@contextlib.contextmanager
def variant(name: str, checks: bool | None = None):
    """``"baseline"``: tile-loop dropout and host checks on; ``"current"``: this code, checks off.
    ``checks`` overrides the checks (meta tensors cannot be read: off for both there)."""
    import bigdense as bd
    import bigdense.layers.base as base_mod
    import bigdense.layers.dropout as dropout_mod
    import bigdense.layers.lora as lora_mod
    import bigdense.models.gpt as gpt_mod

    # Every module that calls tp_dropout by name: the GPT (attention probabilities), base's
    # sequence_dropout (embedding, attention and MLP outputs), ShardedDropout, the low-rank adapters'.
    modules = (gpt_mod, base_mod, dropout_mod, lora_mod)
    saved = [m.tp_dropout for m in modules]
    if name == "baseline":
        for m in modules:
            m.tp_dropout = tiled_dropout
    try:
        with bd.set_checks(name == "baseline" if checks is None else checks):
            yield
    finally:
        for m, fn in zip(modules, saved):
            m.tp_dropout = fn


def _gpt_step(model, optimizer, idx, tp_group):
    import bigdense as bd

    loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    bd.clip_grad_norm_(model, 1.0, tp_group=tp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _count_ops(seqs, batch, lora=0, optim="adamw"):
    """Rank 0 of tp=2 with a fake process group, on meta tensors: ops per step, per variant
    (``lora``: with adapters of that rank, `_with_adapters`; ``optim``: ``adamw`` or ``muon``,
    whose exchange of whole matrices then runs over the fake group too)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import bigdense as bd
    from bigdense.models.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    ctx = bd.init_parallel(tp=2)
    cfg = GPTConfig(**GPT_SMALL, dropout=0.1, attention_dropout=0.1, attention_dropout_mode="invariant")
    with torch.device("meta"):
        model = _with_adapters(GPT(cfg, tp_group=ctx.tp_group), lora)
    optimizer = _optimizer(model, ctx, optim)
    out = {}
    for seq in seqs:
        idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        for name in ("baseline", "current"):
            with variant(name, checks=False), OpCounter() as counter:
                _gpt_step(model, optimizer, idx, ctx.tp_group)
            out[name, seq] = counter.ops
    dist.destroy_process_group()
    return out


def _optimizer(model, ctx, name: str):
    """The counted step's optimizer: torch's foreach AdamW, or bigdense's Muon over the TP group."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    import torch.distributed as dist

    from bigdense.config import OptimConfig
    from bigdense.muon import build_muon

    return build_muon(model, ctx, OptimConfig(name="muon", lr=1e-4), group=dist.group.WORLD, fused=False)


def _with_adapters(model, rank: int):
    """``model`` with LoRA adapters of ``rank`` on every projection (dropout 0.1, as everywhere
    here), the rest frozen; ``model`` as it is for rank 0."""
    import bigdense as bd

    return bd.add_lora(model, r=rank, dropout=0.1) if rank else model


def _timed_gpt(args, compile_mode: str = "false"):
    """The timed GPT (``--d``, ``--layers``, ``--seq``; dropout 0.1 everywhere, fp32) at tp=2 under
    the DDP engine, compiled by ``compile_mode``, and its batch."""
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.models.gpt import GPT, GPTConfig
    from bigdense.train.compile import apply_compile
    from bigdense.train.engines import EngineSettings, build_engine

    ctx = bd.get_default_context()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d, n_layers=args.layers, n_heads=args.heads,
                    max_seq_len=args.seq, dropout=0.1, attention_dropout=0.1, head_chunk_size=1024)
    model = _with_adapters(GPT(cfg, tp_group=ctx.tp_group), args.lora)
    apply_compile(model, compile_mode, args.backend, stage="before_recompute")
    apply_compile(model, compile_mode, args.backend, stage="after_recompute")
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(name=args.optim, warmup_steps=1),
                              precision=PrecisionConfig(),
                              micro_batch_size=args.batch, max_steps=10**6)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return build_engine(model, ctx, settings), [(idx, idx.roll(-1, dims=1))]


def _slowest_step_s(engine, batch) -> float:
    """One ``train_step``'s time on the slowest rank (the ranks start together)."""
    torch.distributed.barrier()
    start = time.perf_counter()
    engine.train_step(batch)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return float(elapsed)


def _timed(args):
    import bigdense as bd

    bd.init_parallel(tp=2)
    engine, batch = _timed_gpt(args)
    times = {"baseline": [], "current": []}
    syncs, ops = {}, {}
    for it in range(args.warmup + args.iters):
        for name in times:
            with variant(name):
                elapsed = _slowest_step_s(engine, batch)
            if it >= args.warmup:
                times[name].append(elapsed)
    for name in times:
        with variant(name), OpCounter() as counter:
            engine.train_step(batch)
        syncs[name], ops[name] = counter.syncs, counter.ops
    return times, syncs, ops


def _timed_compiled(args):
    """Eager against ``args.compile`` (``trainer.compile``'s mode) at tp=2: step times, graph counts
    of the compiled model's first step, ops and host syncs per step."""
    import bigdense as bd
    from bigdense.train.compile_counts import GraphCounts, no_compile_caches

    bd.init_parallel(tp=2)
    engines = {}
    for name, mode in (("eager", "false"), ("compiled", args.compile)):
        engines[name], batch = _timed_gpt(args, mode)
    times = {name: [] for name in engines}
    with bd.set_checks(False):
        with no_compile_caches(), GraphCounts() as graphs:
            engines["compiled"].train_step(batch)
        with GraphCounts() as later:  # what the steps after the first compile: nothing, when guards hold
            for it in range(args.warmup + args.iters):
                for name, engine in engines.items():
                    elapsed = _slowest_step_s(engine, batch)
                    if it >= args.warmup:
                        times[name].append(elapsed)
        with OpCounter() as counter:  # the eager model's forward and backward, as the graphs cover
            engines["eager"].model(*batch[0]).backward()  # (a dispatch mode would run compiled code eagerly)
        engines["eager"].train_step(batch)  # clears those gradients
        with OpCounter() as step_counter:
            engines["eager"].train_step(batch)
    graphs = dict(graphs.as_dict(), recompiled_later=later.graphs_forward + later.graphs_backward,
                  break_reasons=list(graphs.break_reasons))
    return times, graphs, (counter.ops, step_counter.syncs)


def _vec_isa(backend: str) -> str | None:
    """The vector instructions inductor generates its CPU kernels for (``"avx2"``, ``"avx512"``,
    ...; ``"none"``: scalar code), which its kernel count depends on; None for other backends."""
    if backend != "inductor":
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return str(isa) if isa else "none"


def _report_compiled(args) -> list[dict]:
    from bigdense.testing import run_ranks

    times, graphs, eager_counts = run_ranks(_timed_compiled, 2, args, timeout=3600, collective_timeout=600)[0]
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    isa = _vec_isa(args.backend)
    print(f"GPT d={args.d} x {args.layers} layers, {args.heads} heads, vocab {args.vocab}, batch {args.batch}, "
          f"seq {args.seq}, fp32, dropout 0.1 everywhere, tp=2 on 2 gloo CPU processes x 1 thread, engine.train_step: "
          f"eager against trainer.compile={args.compile} (backend {args.backend}), median of {args.iters}, interleaved")
    print(f"  compiled, first step: {graphs['graphs_forward']} forward graph(s), {graphs['graphs_backward']} backward "
          f"graph(s), {graphs['graph_breaks']} graph break(s){': ' + '; '.join(graphs['break_reasons']) if graphs['break_reasons'] else ''}; "
          f"{graphs['recompiled_later']} graph(s) compiled by the later steps")
    print(f"  step time: eager {med['eager']:8.1f} ms   compiled {med['compiled']:8.1f} ms   "
          f"ratio {med['eager'] / med['compiled']:.2f}x")
    print(f"  launches per forward + backward: eager {eager_counts[0]} aten ops   compiled {graphs['kernels']} "
          f"({f'generated kernels for {isa} + aten ops left' if isa else 'aten ops in its graphs'}); "
          f"clipping and AdamW run eagerly in both")
    print(f"  host syncs per step: eager {eager_counts[1]}; compiled: no graph break, so none inside its graphs")
    return [dict(bench="step", metric="compile", compile=args.compile, backend=args.backend, vec_isa=isa, d=args.d,
                 layers=args.layers, seq=args.seq, batch=args.batch, tp=2, **graphs,
                 ops_forward_backward_eager=eager_counts[0], host_syncs_eager=eager_counts[1],
                 step_ms=med["compiled"], step_ms_eager=med["eager"], ratio=med["eager"] / med["compiled"])]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="gpt_small op count: batch")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a small timed model and 3 steps")
    parser.add_argument("--compile", default="false", choices=["false", "blocks", "model"],
                        help="time eager against trainer.compile=MODE instead, with its graphs and breaks")
    parser.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor", "eager"])
    parser.add_argument("--lora", type=int, default=0, help="both variants with LoRA adapters of this rank "
                        "on every projection (the base frozen)")
    parser.add_argument("--optim", default="adamw", choices=["adamw", "muon"],
                        help="both variants with this optimizer (optim.name)")
    parser.add_argument("--json", help="append one JSON object per result to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.d, args.layers, args.seq, args.vocab, args.iters, args.warmup = 64, 2, 64, 1024, 3, 1
    if args.compile != "false":
        results = _report_compiled(args)
        if args.json:
            append_json_lines(args.json, results)
        return

    from bigdense.testing import run_ranks

    counts = run_ranks(_count_ops, 1, (256, 1024), args.batch, args.lora, args.optim, init_process_group=False,
                       timeout=1800)[0]
    times, syncs, ops = run_ranks(_timed, 2, args, timeout=3600, collective_timeout=600)[0]

    results = []
    adapters = f", LoRA r={args.lora} on every projection" if args.lora else ""
    optimizer = "Muon + AdamW" if args.optim == "muon" else "AdamW"
    print(f"gpt_small{adapters}, batch {args.batch}, dropout 0.1 everywhere (attention: invariant), tp=2 rank 0: "
          f"aten ops per training step (forward, backward, clip, {optimizer})")
    for seq in (256, 1024):
        before, after = counts["baseline", seq], counts["current", seq]
        print(f"  seq {seq:5d}: baseline (tile-loop dropout) {before:8d}   current {after:6d}   ratio {before / after:6.1f}x")
        results.append(dict(bench="step", metric="ops_per_step", model="gpt_small", batch=args.batch, seq=seq, tp=2,
                            lora=args.lora, optim=args.optim, baseline=before, current=after, ratio=before / after))
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"GPT d={args.d} x {args.layers} layers, {args.heads} heads, vocab {args.vocab}, batch {args.batch}, "
          f"seq {args.seq}, fp32, dropout 0.1 everywhere, tp=2 on 2 gloo CPU processes x 1 thread, "
          f"engine.train_step, median of {args.iters} after {args.warmup} warm-up, variants interleaved")
    print(f"  step time: baseline {med['baseline']:8.1f} ms   current {med['current']:8.1f} ms   "
          f"ratio {med['baseline'] / med['current']:.2f}x")
    print(f"  host syncs per step: baseline (checks on) {syncs['baseline']}   current (checks off) {syncs['current']}")
    print(f"  aten ops per step at this size: baseline {ops['baseline']}   current {ops['current']}")
    results.append(dict(bench="step", metric="step_time_ms", d=args.d, layers=args.layers, seq=args.seq,
                        batch=args.batch, tp=2, baseline=med["baseline"], current=med["current"],
                        ratio=med["baseline"] / med["current"]))
    results.append(dict(bench="step", metric="host_syncs_per_step", lora=args.lora, optim=args.optim,
                        baseline=syncs["baseline"],
                        current=syncs["current"]))
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    main()
