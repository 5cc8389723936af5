"""The memory planner's predicted peak per rank against the peak measured in a real training step.

    python -m bigdense.bench.plan                                   # tiny and small, tp 1 and 2
    python -m bigdense.bench.plan --models gpt_tiny --batch 8 --seq 128
    python -m bigdense.bench.plan --engine fsdp --models gpt_small --batch 2 --seq 64   # tp2xdp2, tp1xdp4, HSDP

For each reference GPT config, ``--engine ddp`` (the default) measures each TP size (gloo CPU
processes; sequence parallelism off and on), precision and recompute mode; ``--engine fsdp``
each layout of ``--fsdp-layouts`` (``TPxDP``, ``rR``: HSDP with ``engine.dp_replicate=R``; 4
processes each by default), precision and ``--accums``: the peak of live tensor bytes during a
training step after the first (`bigdense.plan.measure`), measured on every rank (the largest
printed), and ``estimate_config``'s prediction for ``plan.device_type=cpu``.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from omegaconf import OmegaConf


def _measure(overrides):
    from bigdense.plan.__main__ import DEFAULT_CONF, compose
    from bigdense.plan.measure import measure_config

    return measure_config(compose(overrides, DEFAULT_CONF))


def _ddp_cases(args):
    """``(label, overrides)`` of the DDP sweep."""
    for model in args.models:
        for tp, sp in [(tp, sp) for tp in args.tps for sp in ((False, True) if tp > 1 else (False,))]:
            for precision in ("fp32", "bf16"):
                for recompute in ("none", "full"):
                    yield (f"{model:<10} {tp:>2} {'yes' if sp else 'no':>3} {precision:>9} {recompute:>9}",
                           [f"model={model}", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                            f"precision={precision}", f"recompute={recompute}"])


def _fsdp_cases(args):
    """``(label, overrides)`` of the FSDP sweep: ``--fsdp-layouts`` x precision x ``--accums``."""
    for model in args.models:
        for layout in args.fsdp_layouts:
            tp, dp, replicate = re.fullmatch(r"(\d+)x(\d+)(?:r(\d+))?", layout).groups()
            for precision in ("fp32", "bf16"):
                for accum in args.accums:
                    yield (f"{model:<10} {layout:>6} {precision:>9} {accum:>5}",
                           [f"model={model}", "engine=fsdp", f"parallel.tp={tp}", f"parallel.dp={dp}",
                            f"engine.dp_replicate={replicate or 1}", f"precision={precision}",
                            f"data.grad_accum={accum}"])


def main(argv=None) -> None:
    from bigdense.config import PlanConfig
    from bigdense.plan.__main__ import DEFAULT_CONF, compose
    from bigdense.plan.config import estimate_config
    from bigdense.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--models", nargs="+", default=["gpt_tiny", "gpt_small"])
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2], help="ddp: the TP sizes")
    parser.add_argument("--fsdp-layouts", nargs="+", default=["2x2", "1x4", "1x4r2"], help="fsdp: TPxDP[rR]")
    parser.add_argument("--accums", type=int, nargs="+", default=[1, 2], help="fsdp: data.grad_accum values")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    plan = OmegaConf.merge(OmegaConf.structured(PlanConfig), {"device_type": "cpu"})
    rows = []
    header = (f"{'model':<10} {'tp':>2} {'SP':>3} {'precision':>9} {'recompute':>9}" if args.engine == "ddp"
              else f"{'model':<10} {'layout':>6} {'precision':>9} {'accum':>5}")
    print(f"predicted vs measured peak bytes per rank, micro-batch {args.batch} x {args.seq} tokens, "
          f"engine={args.engine}, a training step after the first")
    print(f"  {header} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}  phase")
    cases = _ddp_cases(args) if args.engine == "ddp" else _fsdp_cases(args)
    for label, overrides in cases:
        overrides = overrides + [f"data.micro_batch_size={args.batch}", f"data.seq_len={args.seq}"]
        est = estimate_config(compose(overrides, DEFAULT_CONF), plan)
        world = est.layout.tp * est.layout.dp
        measured = max(r["peak_bytes"] for r in run_ranks(_measure, world, overrides, timeout=3600))
        err = est.peak_bytes / measured - 1
        rows.append({"overrides": overrides, "predicted_bytes": est.peak_bytes,
                     "measured_bytes": measured, "relative_error": err, "phase": est.peak_phase})
        print(f"  {label} {est.peak_bytes / 2**20:>13.1f} {measured / 2**20:>12.1f} {err:>+7.2%}  {est.peak_phase}",
              flush=True)
    print(f"largest error: {max(abs(r['relative_error']) for r in rows):.2%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
