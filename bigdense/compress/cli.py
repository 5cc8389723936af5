"""The command line of `python -m bigdense.compress` (the package docstring says what it does)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..compression.pruning import STRUCTURES
from . import int8 as int8_method, lowrank as lowrank_method, prune as prune_method
from .fine_tune import fine_tune_command
from .measure import DENSE, held_out_loss, load_reference_gpt

DESCRIPTION = "Compress a trained checkpoint's dense layers: low-rank factors, pruning, or int8 weights."


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.compress", description=DESCRIPTION)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ or latest pointer")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--energy", type=float, help="low rank: keep this fraction of each layer's squared singular values")
    which.add_argument("--rank", type=int, help="low rank: the same rank for every layer")
    which.add_argument("--prune", type=float, metavar="SPARSITY",
                       help="prune this fraction of the weights (of the MLPs' hidden units with --structure rows)")
    which.add_argument("--int8", action="store_true", help="int8 weights with one scale per output feature")
    parser.add_argument("--structure", choices=STRUCTURES, default=None,
                        help="with --prune: unstructured (default; one magnitude threshold), n:m (2:4: --prune 0.5), "
                             "rows (hidden units of every block's MLP)")
    parser.add_argument("--layers", default="blocks.*", help="comma-separated fnmatch patterns of module names")
    parser.add_argument("--out", type=Path, help="output checkpoint directory (default: CHECKPOINT-<method>-...)")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="held-out batches for the loss before/after (default: trainer.eval_batches; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the randomised SVD's seed")
    args = parser.parse_args(argv)
    if args.structure is not None and args.prune is None:
        parser.error("--structure goes with --prune")
    if args.prune is not None and args.structure is None:
        args.structure = "unstructured"
    return args


def method(args) -> str:
    return "lowrank" if args.energy is not None or args.rank is not None else "prune" if args.prune is not None \
        else "int8"


def out_name(args) -> str:
    """The default output directory's suffix."""
    if args.energy is not None or args.rank is not None:
        return "lowrank-" + (f"e{args.energy:g}" if args.energy is not None else f"r{args.rank}")
    if args.prune is not None:
        return f"pruned-{args.structure.replace(':', '')}-{args.prune:g}"
    return "int8"


def _compress(args, model, cfg, patterns, tokens) -> tuple[list[dict], dict]:
    """(per-layer rows, the report's method entries): the model compressed in place, ``cfg`` updated."""
    kind = method(args)
    if kind == "lowrank":
        rows = lowrank_method.compress_model(model, patterns, energy=args.energy, rank=args.rank, tokens=tokens,
                                             seed=args.seed)
        return rows, lowrank_method.record(cfg, rows) if rows else {}
    if kind == "int8":
        rows = int8_method.quantize_layers(model, patterns, tokens)
        return rows, int8_method.record(cfg, rows) if rows else {}
    if args.structure == "rows":
        rows = prune_method.prune_rows(model, patterns, args.prune, tokens)
    else:
        rows = prune_method.prune_masks(model, patterns, args.prune, args.structure, tokens)
    return rows, prune_method.record(cfg, model, rows, args.prune, args.structure) if rows else {}


def _fine_tune(kind: str, args, out) -> list[str]:
    """The overrides that fine-tune the written checkpoint with launch/train.py; none where it does not
    apply (int8 is for inference)."""
    if kind in ("lowrank", "prune"):
        return [f"trainer.init_from={out}"]
    return []


def run(args) -> dict:
    """Load, evaluate, compress, evaluate, save; returns the report (every rank)."""
    from .. import init_parallel, save_checkpoint
    from ..checkpoint.format import read_manifest, resolve_checkpoint
    from ..jobs.setup import launcher_world

    source = resolve_checkpoint(args.checkpoint)
    out = args.out or source.parent / f"{source.name}-{out_name(args)}"
    ctx = init_parallel(tp=launcher_world()[1])
    model, cfg, step = load_reference_gpt(source, ctx)
    n_eval = cfg.trainer.eval_batches if args.eval_batches is None else args.eval_batches
    # The windows the run evaluated, whose number depends on its DP size: "before" is then the
    # held-out loss the run logged at this checkpoint's step.
    run_dp = (read_manifest(source).get("layout") or {}).get("dp")
    tokens = int(cfg.data.micro_batch_size) * int(cfg.data.seq_len)
    loss_before = held_out_loss(model, cfg, ctx, n_eval, run_dp) if n_eval else None
    patterns = [p.strip() for p in args.layers.split(",") if p.strip()]
    rows, entries = _compress(args, model, cfg, patterns, tokens)
    if not rows:
        names = [n for n, m in model.named_modules() if isinstance(m, DENSE)][:6]
        raise ValueError(f"bigdense.compress: --layers {args.layers!r} matches no dense layer (names look like {names})")
    loss_after = held_out_loss(model, cfg, ctx, n_eval, run_dp) if n_eval else None
    save_checkpoint(out, model, step=step, config=cfg, update_latest=False)
    kind = method(args)
    if kind == "prune" and args.structure != "rows":
        prune_method.time_sparse(model, rows, tokens)  # after the save: sparse layers' weights are not saved
    report = {"source": str(source), "out": str(out), "method": kind, "energy": args.energy, "rank": args.rank,
              "prune": args.prune, "structure": args.structure, "tp": ctx.tp_size, "tokens_timed": tokens,
              "layers": rows, "held_out_loss_before": loss_before, "held_out_loss_after": loss_after,
              "params_before": sum(r["params_before"] for r in rows), "params_after": sum(r["params_after"] for r in rows),
              **entries, "fine_tune_overrides": _fine_tune(kind, args, out)}
    fine_tunes = bool(report["fine_tune_overrides"])
    report["fine_tune_command"] = fine_tune_command(source, out, ctx.world_size) if fine_tunes else None
    if ctx.is_main:
        (Path(out) / "compress_report.json").write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict) -> str:
    lines = [f"{'layer':<22} {'change':>22} {'params before':>14} {'after':>10} {'rel. error':>10} "
             f"{'fwd ms before':>13} {'after':>8}"]
    for r in report["layers"]:
        lines.append(f"{r['layer']:<22} {r['change']:>22} {r['params_before']:>14,} {r['params_after']:>10,} "
                     f"{r['relative_frobenius_error']:>10.4f} {r['forward_ms_before']:>13.3f} {r['forward_ms_after']:>8.3f}")
    lines.append(f"compressed layers: {report['params_before']:,} -> {report['params_after']:,} parameters"
                 + (" (nonzero)" if report["method"] == "prune" and report["structure"] != "rows" else ""))
    if report["held_out_loss_before"] is not None:
        lines.append(f"held-out loss: {report['held_out_loss_before']:.4f} -> {report['held_out_loss_after']:.4f}")
    lines.append(f"written: {report['out']}")
    if report["fine_tune_command"]:  # on a line of its own, to be copied as it is
        lines.append("fine-tune it (the run takes the compressed structure from the checkpoint), from the repository "
                     "root:")
        lines.append("  " + shlex.join(report["fine_tune_command"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    from .. import destroy_parallel, get_default_context
    from ..checkpoint.format import CheckpointError
    from ..compression.lowrank import check_energy
    from ..compression.pruning import check_sparsity

    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.energy is not None:
            check_energy(args.energy, "bigdense.compress --energy")
        if args.prune is not None:
            check_sparsity(args.prune, args.structure, 2, 4)
        report = run(args)
    except (ValueError, TypeError, CheckpointError) as err:
        print(f"bigdense.compress: {err}", file=sys.stderr)
        return 2
    ctx = get_default_context()
    if ctx is None or ctx.is_main:
        print(format_report(report))
    destroy_parallel()
    return 0
