"""Sequence parallelism and communication overlap, measured on `gpt_small` shapes.

    python -m bigdense.bench.block                                   # tp = 1, 2, 4; seq 512, 12 layers
    python -m bigdense.bench.block --tp 1 2 --seq 128 --layers 2     # a quick look
    python -m bigdense.bench.block --device cuda                     # NCCL, one GPU per rank

Every configuration (tp; sequence parallelism off/on; overlap on/off) runs in fresh processes
(gloo CPU processes x 1 thread, or one GPU per rank), and reports per rank:

- **saved activation bytes** of one transformer block's forward in training mode (dropout on,
  bf16 parameters and activations, as Megatron's accounting assumes), counted with saved-tensor
  hooks, each storage once, parameters excluded; printed beside Megatron's per-layer formula
  ``sbh(34 + 5as/h)`` bytes (``/t`` with TP and SP; Korthikanti et al. 2022, eq. 1 and 5), whose
  ``5as/h`` term (the s x s attention probabilities) applies only with ``--attention-dropout`` > 0:
  otherwise attention is SDPA, which keeps no s x s matrix;
- **peak memory** of one full training step (forward, backward, AdamW) of the model:
  ``torch.cuda.max_memory_allocated`` on GPU, the process's peak resident set on CPU;
- **step time**, the median over steps of the slowest rank, fp32;
- **all-reduces** issued by bigdense in a plain forward and ``loss.backward()`` (with SP: the
  layers' own sums of their replicated parameters' partial gradients, one per parameter) and in one
  step of the DDP engine (which defers those sums to one all-reduce per step; it adds two scalars).

Ratios are against tp=1 (bytes) and against the same tp without SP (time), measured in the same
run. ``--json PATH`` writes one JSON object per configuration.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from . import peak_rss_bytes

CONFIGS = (  # (sequence_parallel, overlap_comm)
    (False, True), (False, False), (True, True), (True, False),
)


def _model_cfg(args, sequence_parallel, overlap_comm):
    from bigdense.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab, d_model=768, n_layers=args.layers, n_heads=12, max_seq_len=args.seq,
        dropout=0.1, attention_dropout=args.attention_dropout, head_chunk_size=4096,
        sequence_parallel=sequence_parallel, overlap_comm=overlap_comm,
    )


def saved_activation_bytes(module, x, **kwargs) -> int:
    """Bytes the autograd graph of ``module(x)`` keeps for backward: every saved tensor's storage
    once, parameters (which exist anyway) not counted."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, **kwargs)
    return sum(storages.values())


def _block_saved_bytes(args, ctx, cfg) -> int:
    from bigdense.models.gpt import Block
    from bigdense.parallel import comm

    torch.manual_seed(0)
    with torch.device(ctx.device):
        block = Block(cfg, ctx.tp_group).to(torch.bfloat16).train()
        x = torch.randn(args.batch, args.seq, cfg.d_model, dtype=torch.bfloat16)
    if cfg.sequence_parallel:
        x = comm.split_dim(x, -2, ctx.tp_group)
    return saved_activation_bytes(block, x.requires_grad_(), seq_len=args.seq)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(args, tp, sequence_parallel, overlap_comm):
    import bigdense as bd
    from bigdense.models import GPT

    ctx = bd.init_parallel(tp=tp, backend="nccl" if args.device == "cuda" else "gloo")
    cfg = _model_cfg(args, sequence_parallel, overlap_comm)
    saved = _block_saved_bytes(args, ctx, cfg)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = GPT(cfg, tp_group=ctx.tp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(ctx.device)
    bd.set_checks(False)  # the training loop's hot-path setting
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        _sync(ctx.device)
        start = time.perf_counter()
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(ctx.device)
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(slowest))
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
    else:
        peak = peak_rss_bytes()
    with bd.count_collectives() as plain:  # forward + backward; with SP the layers sum partial gradients one by one
        model(idx[:, :-1], idx[:, 1:]).backward()
    opt.zero_grad(set_to_none=True)
    with bd.count_collectives() as engine_step:  # the DDP engine's step: partial sums deferred to one
        _ddp_engine(model, ctx, args).train_step([(idx[:, :-1], idx[:, 1:])])
    return {"saved_bytes": saved, "peak_bytes": peak, "step_s": statistics.median(times),
            "all_reduces_fwd_bwd": plain.calls("all_reduce"), "all_reduces_engine_step": engine_step.calls("all_reduce")}


def _ddp_engine(model, ctx, args):
    import bigdense as bd
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    return bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OptimConfig(),
                           precision_cfg=PrecisionConfig(), micro_batch_size=args.batch, max_steps=1)


def megatron_bytes(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool, probabilities: bool) -> float:
    """Activation bytes per layer by Megatron's formulas: ``sbh(34 + 5as/h)`` unsharded,
    ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh(34 + 5as/h)/t`` with TP and SP; without the
    ``5as/h`` term when the attention probabilities are not kept (SDPA)."""
    attention = 5 * a * s / h if probabilities else 0.0
    if sequence_parallel or t == 1:
        return s * b * h * (34 + attention) / t
    return s * b * h * (10 + 24 / t + attention / t)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="> 0: layout-free dropout on the attention probabilities (they are then kept)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", default=None, help="write one JSON object per configuration here")
    args = parser.parse_args(argv)

    from bigdense.testing import run_ranks

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    results = []
    for tp in args.tp:
        if args.device == "cuda" and tp > gpus:
            print(f"tp={tp}: skipped, {gpus} GPU(s) present")
            continue
        for sp, overlap in CONFIGS if tp > 1 else CONFIGS[:1]:
            # CUDA cannot be used in forked children once the parent touched it: spawn them.
            per_rank = run_ranks(_rank, tp, args, tp, sp, overlap, timeout=3600, collective_timeout=900,
                                 init_process_group=False, start_method="spawn" if args.device == "cuda" else None)
            results.append({
                "tp": tp, "sequence_parallel": sp, "overlap_comm": overlap,
                "saved_bytes": max(r["saved_bytes"] for r in per_rank),
                "peak_bytes": max(r["peak_bytes"] for r in per_rank),
                "step_s": per_rank[0]["step_s"],
                "all_reduces_fwd_bwd": per_rank[0]["all_reduces_fwd_bwd"],
                "all_reduces_engine_step": per_rank[0]["all_reduces_engine_step"],
            })
    _report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            for row in results:
                f.write(json.dumps({**vars(args), **row, "json": None}) + "\n")


def _report(args, results) -> None:
    s, b, h, a = args.seq, args.batch, 768, 12
    base = next((r for r in results if r["tp"] == 1), None)
    print(
        f"gpt_small block (d=768, 12 heads, dropout 0.1, attention dropout {args.attention_dropout}), batch {args.batch}, seq {args.seq}; full step: "
        f"{args.layers} layers, vocab {args.vocab}, fp32, AdamW; median of {args.steps} steps after {args.warmup}; "
        f"{args.device} ({'gloo processes x 1 thread' if args.device == 'cpu' else 'NCCL'})"
    )
    probabilities = args.attention_dropout > 0
    term = "sbh(34 + 5as/h)" if probabilities else "sbh*34 (SDPA: no 5as/h term)"
    print(f"Megatron's formula per layer, bf16: {term} = "
          f"{megatron_bytes(s, b, h, a, 1, False, probabilities) / 2**20:.1f} MiB at t=1")
    print(f"{'tp':>3} {'SP':>3} {'overlap':>7} | {'saved/rank MiB':>14} {'vs tp=1':>8} {'target':>7} "
          f"{'formula MiB':>11} | {'peak/rank MiB':>13} | {'step ms':>8} {'vs no SP':>8} {'on/off':>7} | "
          f"{'all-reduces: fwd+bwd':>20} {'engine step':>11}")
    for r in results:
        same_tp = next(x for x in results if x["tp"] == r["tp"] and x["overlap_comm"] == r["overlap_comm"]
                       and not x["sequence_parallel"]) if r["tp"] > 1 else r
        other = [x for x in results if (x["tp"], x["sequence_parallel"]) == (r["tp"], r["sequence_parallel"])
                 and x["overlap_comm"] != r["overlap_comm"]]
        # step time with overlap over without, on the overlap-on row
        on_off = f"{r['step_s'] / other[0]['step_s']:.3f}" if other and r["overlap_comm"] else ""
        ratio = r["saved_bytes"] / base["saved_bytes"] if base else float("nan")
        target = f"{1.1 / r['tp']:.3f}" if r["sequence_parallel"] else "-"
        formula = megatron_bytes(s, b, h, a, r["tp"], r["sequence_parallel"], probabilities)
        print(
            f"{r['tp']:>3} {'on' if r['sequence_parallel'] else 'off':>3} {'on' if r['overlap_comm'] else 'off':>7} | "
            f"{r['saved_bytes'] / 2**20:>14.1f} {ratio:>8.3f} {target:>7} {formula / 2**20:>11.1f} | "
            f"{r['peak_bytes'] / 2**20:>13.0f} | {r['step_s'] * 1e3:>8.0f} {r['step_s'] / same_tp['step_s']:>8.3f} "
            f"{on_off:>7} | {r['all_reduces_fwd_bwd']:>20} {r['all_reduces_engine_step']:>11}"
        )


if __name__ == "__main__":
    main()
