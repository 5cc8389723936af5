"""Compress a trained checkpoint's dense layers with low-rank factors (`bd.low_rank`).

    python -m bigdense.compress CHECKPOINT --energy 0.9 [--layers PATTERN] [--out DIR]
    torchrun --nproc_per_node=2 -m bigdense.compress CHECKPOINT --rank 32    # sharded, any TP size

CHECKPOINT is one written by `launch/train.py` (its manifest holds the training config, hence the
model). Each dense layer whose module name matches a PATTERN (fnmatch; default ``blocks.*``) is
replaced by its low-rank pair, unless the pair would not be smaller. Writes a checkpoint of the
compressed model (``--out``, any TP size can load it) and ``compress_report.json`` there: per layer
the rank, parameters and FLOPs per token before/after, the relative Frobenius error
``||W - W_r||_F / ||W||_F`` (computed over the shards), the forward time before/after; and the
held-out loss before and after. Fine-tune it with ``trainer.init_from=DIR``: the training job takes
the low-rank structure (``model.low_rank``, recorded in the checkpoint's config) from it.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .layers import ColumnParallelLinear, ParallelClassifierHead, RowParallelLinear
from .layers.lowrank import low_rank
from .parallel import comm

DENSE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def dense_layers(model: nn.Module, patterns) -> list[str]:
    """Names of the compressible layers matching any pattern (heads are not: their loss reads W whole)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, DENSE) and not isinstance(m, ParallelClassifierHead)
            and any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _input_width(layer) -> int:
    if isinstance(layer, RowParallelLinear) and layer.input_is_parallel:
        return layer.partition_size
    return layer.in_features


def forward_ms(layer: nn.Module, tokens: int, repeats: int = 5) -> float:
    """Median forward time of ``layer`` on (tokens, in) inputs, ms (every TP rank runs it together)."""
    first = next(layer.parameters())
    width = _input_width(layer[0] if isinstance(layer, nn.Sequential) else layer)
    x = torch.randn(tokens, width, device=first.device, dtype=first.dtype)
    times = []
    with torch.no_grad():
        layer(x)
        for _ in range(repeats):
            t = time.perf_counter()
            layer(x)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def relative_error(layer: nn.Module, pair: nn.Sequential) -> float:
    """``||W - second.W @ first.W||_F / ||W||_F``, summed over this rank's rows or columns of W."""
    first, second = pair
    approx = second.weight @ first.weight  # this rank's rows (column) or columns (row) of W_r
    w = layer.weight.detach().float()
    sums = torch.stack([(w - approx.float()).pow(2).sum(), w.pow(2).sum()]).double()
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        comm.all_reduce_(sums, layer.tp_group)
    return float((sums[0] / sums[1]).sqrt())


def _counts(in_f: int, out_f: int, rank: Optional[int], bias: bool) -> dict:
    dense = in_f * out_f
    factored = dense if rank is None else rank * (in_f + out_f)
    return {"params_before": dense + bias * out_f, "params_after": factored + bias * out_f,
            "flops_per_token_before": 2 * dense, "flops_per_token_after": 2 * factored}


def compress_model(model: nn.Module, patterns, *, energy=None, rank=None, tokens: int = 1024,
                   seed: int = 0) -> list[dict]:
    """Replace the matching dense layers of ``model`` in place by low-rank pairs; per-layer rows.

    A layer whose pair would not have fewer parameters stays dense (its row says ``"kept": true``).
    Collective when the model is sharded.
    """
    rows = []
    for name in dense_layers(model, patterns):
        layer = model.get_submodule(name)
        before_ms = forward_ms(layer, tokens)
        t = time.perf_counter()
        pair = low_rank(layer, rank=rank, energy=energy, seed=seed)
        svd_s = time.perf_counter() - t
        in_f, out_f = layer.in_features, layer.out_features
        kept = pair.rank * (in_f + out_f) >= in_f * out_f
        row = {"layer": name, "type": type(layer).__name__, "in": in_f, "out": out_f, "rank": pair.rank,
               "kept": kept, **_counts(in_f, out_f, None if kept else pair.rank, layer.bias is not None),
               "relative_frobenius_error": 0.0 if kept else relative_error(layer, pair), "svd_s": svd_s,
               "forward_ms_before": before_ms}
        if not kept:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, pair)
        row["forward_ms_after"] = forward_ms(pair, tokens) if not kept else before_ms
        rows.append(row)
    return rows


def held_out_loss(model, cfg, ctx, n_batches: int) -> float:
    """Mean held-out loss of the reference GPT on the run's own validation batches (DP-averaged)."""
    from .data import prepare_data
    from .train.precision import autocast

    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    model.eval()
    losses = []
    with torch.no_grad(), autocast(cfg.precision.dtype, ctx.device):
        for x, y in data.val_batches(n_batches, ctx.dp_rank, ctx.dp_size):
            losses.append(float(model(x.to(ctx.device), y.to(ctx.device))))
    loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    comm.all_reduce_(loss, ctx.dp_group)
    return float(loss) / ctx.dp_size


def load_reference_gpt(path, ctx):
    """(model, training config, step) of a `launch/train.py` checkpoint, sharded over ``ctx``:
    built and loaded through the jobs' `parallelize_model`, for evaluation (no compile, no
    activation checkpointing, no engine)."""
    from omegaconf import OmegaConf

    from .checkpoint.format import read_manifest, resolve_checkpoint
    from .jobs import build_gpt, parallelize_model

    manifest = read_manifest(resolve_checkpoint(path))
    if not manifest.get("config"):
        raise ValueError(f"bigdense.compress: {path} records no training config (save it with config=cfg)")
    cfg = OmegaConf.create(manifest["config"])
    vocab = manifest["tensors"]["model/tok_emb.weight"]["global_shape"][0]
    for_evaluation = OmegaConf.merge(cfg, {"trainer": {"compile": False}, "recompute": {"mode": "none"}})
    model = parallelize_model(build_gpt(for_evaluation, vocab, ctx), ctx, for_evaluation, init_from=str(path),
                              engine=False).model
    return model, cfg, manifest.get("step")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.compress", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ or latest pointer")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--energy", type=float, help="keep this fraction of each layer's squared singular values")
    which.add_argument("--rank", type=int, help="the same rank for every layer")
    parser.add_argument("--layers", default="blocks.*", help="comma-separated fnmatch patterns of module names")
    parser.add_argument("--out", type=Path, help="output checkpoint directory (default: CHECKPOINT-lowrank-...)")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="held-out batches for the loss before/after (default: trainer.eval_batches; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the randomised SVD's seed")
    return parser.parse_args(argv)


def run(args) -> dict:
    """Load, evaluate, compress, evaluate, save; returns the report (every rank)."""
    from omegaconf import OmegaConf

    from . import init_parallel, save_checkpoint
    from .checkpoint.format import resolve_checkpoint
    from .jobs.setup import launcher_world

    source = resolve_checkpoint(args.checkpoint)
    tag = f"e{args.energy:g}" if args.energy is not None else f"r{args.rank}"
    out = args.out or source.parent / f"{source.name}-lowrank-{tag}"
    ctx = init_parallel(tp=launcher_world()[1])
    model, cfg, step = load_reference_gpt(source, ctx)
    n_eval = cfg.trainer.eval_batches if args.eval_batches is None else args.eval_batches
    tokens = int(cfg.data.micro_batch_size) * int(cfg.data.seq_len)
    loss_before = held_out_loss(model, cfg, ctx, n_eval) if n_eval else None
    patterns = [p.strip() for p in args.layers.split(",") if p.strip()]
    rows = compress_model(model, patterns, energy=args.energy, rank=args.rank, tokens=tokens, seed=args.seed)
    if not rows:
        names = [n for n, m in model.named_modules() if isinstance(m, DENSE)][:6]
        raise ValueError(f"bigdense.compress: --layers {args.layers!r} matches no dense layer (names look like {names})")
    loss_after = held_out_loss(model, cfg, ctx, n_eval) if n_eval else None
    low = dict(cfg.model.get("low_rank") or {})
    low.update({r["layer"]: r["rank"] for r in rows if not r["kept"]})
    OmegaConf.update(cfg, "model.low_rank", low, merge=False)
    save_checkpoint(out, model, step=step, config=cfg, update_latest=False)
    report = {"source": str(source), "out": str(out), "energy": args.energy, "rank": args.rank, "tp": ctx.tp_size,
              "tokens_timed": tokens, "layers": rows, "held_out_loss_before": loss_before,
              "held_out_loss_after": loss_after, "params_before": sum(r["params_before"] for r in rows),
              "params_after": sum(r["params_after"] for r in rows),
              "low_rank": low, "fine_tune_overrides": [f"trainer.init_from={out}"]}
    if ctx.is_main:
        (Path(out) / "compress_report.json").write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict) -> str:
    lines = [f"{'layer':<22} {'rank':>5} {'params before':>14} {'after':>10} {'rel. error':>10} "
             f"{'fwd ms before':>13} {'after':>8}"]
    for r in report["layers"]:
        rank = "dense" if r["kept"] else str(r["rank"])
        lines.append(f"{r['layer']:<22} {rank:>5} {r['params_before']:>14,} {r['params_after']:>10,} "
                     f"{r['relative_frobenius_error']:>10.4f} {r['forward_ms_before']:>13.3f} {r['forward_ms_after']:>8.3f}")
    lines.append(f"compressed layers: {report['params_before']:,} -> {report['params_after']:,} parameters")
    if report["held_out_loss_before"] is not None:
        lines.append(f"held-out loss: {report['held_out_loss_before']:.4f} -> {report['held_out_loss_after']:.4f}")
    lines.append(f"written: {report['out']}; fine-tune with: torchrun launch/train.py "
                 + " ".join(report["fine_tune_overrides"]) + " (it takes model.low_rank from there)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from . import destroy_parallel, get_default_context
    from .checkpoint.format import CheckpointError
    from .layers.lowrank import check_energy

    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.energy is not None:
            check_energy(args.energy, "bigdense.compress --energy")
        report = run(args)
    except (ValueError, TypeError, CheckpointError) as err:
        print(f"bigdense.compress: {err}", file=sys.stderr)
        return 2
    ctx = get_default_context()
    if ctx is None or ctx.is_main:
        print(format_report(report))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
