"""Low-rank compression: Fast R-CNN's truncated-SVD case, and the reference GPT at several energies.

    python -m bigdense.bench.lowrank                          # both parts; trains the GPT briefly first
    python -m bigdense.bench.lowrank --checkpoint outputs/torchrun-xyz/checkpoints   # the main job's
    python -m bigdense.bench.lowrank --skip-gpt --rois 128    # only the Fast R-CNN layers

Part 1 (Girshick, Fast R-CNN, 2015, section 3.1): VGG-16's fc6 (25,088 -> 4,096) at rank 1,024
and fc7 (4,096 -> 4,096) at rank 256, at tp = 1 (nn.Linear) and tp = 2 (fc6 column-parallel,
fc7 row-parallel, as ``bd.parallelize`` shards the classifier), each on gloo CPU processes with one
thread. No pretrained weights are downloaded: the weights are synthetic with a trained layer's
slowly decaying spectrum (sigma_i ~ (1 + i)^-1/2, random singular vectors), so the relative error
is that spectrum's, not VGG's. Printed per layer: parameters, forward time of ``--rois`` rows
before and after (median of ``--iters``, the same run), the SVD's time and the relative
Frobenius error.

Part 2: the reference GPT (a `launch/train.py` checkpoint; without ``--checkpoint`` the main job
is run for ``--train-steps`` steps first) compressed by ``python -m bigdense.compress`` at each
``--energies`` value, with its held-out loss before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

FAST_RCNN = [("fc6", 25088, 4096, 1024), ("fc7", 4096, 4096, 256)]


def synthetic_weight(out_f: int, in_f: int, rows: slice, seed: int) -> torch.Tensor:
    """Rows ``rows`` of ``U diag(s) V^T / ...`` with Gaussian U, V and s_i = (1 + i)^-1/2, built from
    this rank's rows of U only (the same global matrix at any TP size)."""
    k = min(out_f, in_f)
    s = (1.0 + torch.arange(k, dtype=torch.float32)) ** -0.5
    u = torch.randn(out_f, k, generator=torch.Generator().manual_seed(seed))[rows]
    v = torch.randn(in_f, k, generator=torch.Generator().manual_seed(seed + 1))
    return (u * s) @ v.t() / math.sqrt(in_f)


def _layer(kind: str, out_f: int, in_f: int, seed: int, ctx):
    import bigdense as bd
    from bigdense.parallel.sharding import shard_range

    if ctx.tp_size == 1:
        layer = nn.Linear(in_f, out_f, device="meta").to_empty(device="cpu")
    else:
        cls = bd.ColumnParallelLinear if kind == "column" else bd.RowParallelLinear
        layer = cls(in_f, out_f, device="meta").to_empty(device="cpu")
    lo, hi = shard_range(out_f if kind == "column" else in_f, ctx.tp_size, ctx.tp_rank)
    if kind == "column":
        layer.weight.data = synthetic_weight(out_f, in_f, slice(lo, hi), seed)
    else:  # the global matrix's columns lo:hi, from its transpose's rows
        layer.weight.data = synthetic_weight(in_f, out_f, slice(lo, hi), seed).t().contiguous()
    nn.init.zeros_(layer.bias)
    return layer


def _fast_rcnn_ranks(tp: int, rois: int, iters: int):
    import bigdense as bd
    from bigdense.compress import forward_ms, relative_error

    ctx = bd.init_parallel(tp=tp)
    rows = []
    for (name, in_f, out_f, rank), kind in zip(FAST_RCNN, ("column", "row")):
        layer = _layer(kind, out_f, in_f, seed=len(rows) * 7 + 1, ctx=ctx)
        before = forward_ms(layer, rois, iters)
        t = time.perf_counter()
        pair = bd.low_rank(layer, rank=rank)
        svd_s = time.perf_counter() - t
        after = forward_ms(pair, rois, iters)
        rows.append({"layer": name, "tp": tp, "in": in_f, "out": out_f, "rank": rank,
                     "params_before": in_f * out_f + out_f, "params_after": rank * (in_f + out_f) + out_f,
                     "forward_ms_before": before, "forward_ms_after": after, "speedup": before / after,
                     "svd_s": svd_s, "relative_frobenius_error": relative_error(layer, pair)})
    return rows


def fast_rcnn(args) -> list[dict]:
    from bigdense.testing import run_ranks

    rows = []
    for tp in args.tps:
        rows += run_ranks(_fast_rcnn_ranks, tp, tp, args.rois, args.iters, timeout=7200, collective_timeout=3600)[0]
    return rows


def trained_checkpoint(args) -> Path:
    """The checkpoint to compress: ``--checkpoint``, or a short run of the main job."""
    if args.checkpoint:
        return Path(args.checkpoint)
    root = Path(__file__).resolve().parents[2]
    run_dir = Path(args.work_dir) / "gpt"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2",
           str(root / "launch" / "train.py"), f"trainer.max_steps={args.train_steps}", "trainer.plot=false",
           "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=root)
    return run_dir / "checkpoints"


def gpt(args) -> list[dict]:
    from bigdense import compress, destroy_parallel

    ckpt = trained_checkpoint(args)
    out = []
    for energy in args.energies:
        target = Path(args.work_dir) / f"gpt-e{energy:g}"
        report = compress.run(compress.parse([str(ckpt), "--energy", str(energy), "--out", str(target)]))
        destroy_parallel()
        out.append(report)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rois", type=int, default=256, help="rows per forward (Fast R-CNN: RoIs per batch)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--checkpoint", help="a launch/train.py checkpoint of the reference GPT")
    parser.add_argument("--train-steps", type=int, default=200, help="without --checkpoint: steps of the main job")
    parser.add_argument("--energies", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    parser.add_argument("--work-dir", default="outputs/bench-lowrank")
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    results = {"fast_rcnn": fast_rcnn(args)}
    print(f"Fast R-CNN truncated SVD, synthetic spectrum, {args.rois} rows per forward, fp32, "
          f"gloo CPU processes x 1 thread, median of {args.iters}")
    print(f"  {'layer':<5} {'tp':>2} {'rank':>5} {'params before':>14} {'after':>11} {'fwd ms before':>13} "
          f"{'after':>8} {'speed-up':>8} {'SVD s':>7} {'rel. error':>10}")
    for r in results["fast_rcnn"]:
        print(f"  {r['layer']:<5} {r['tp']:>2} {r['rank']:>5} {r['params_before']:>14,} {r['params_after']:>11,} "
              f"{r['forward_ms_before']:>13.2f} {r['forward_ms_after']:>8.2f} {r['speedup']:>7.2f}x "
              f"{r['svd_s']:>7.1f} {r['relative_frobenius_error']:>10.4f}")
    if not args.skip_gpt:
        results["gpt"] = gpt(args)
        print("reference GPT, every dense layer of the blocks, held-out loss before -> after:")
        for energy, rep in zip(args.energies, results["gpt"]):
            ranks = [r["rank"] for r in rep["layers"] if not r["kept"]]
            which = (f"{len(ranks)} of {len(rep['layers'])} layers at ranks {min(ranks)}-{max(ranks)}" if ranks
                     else "no layer (no pair would be smaller)")
            print(f"  energy {energy:<5g} block params {rep['params_before']:>10,} -> {rep['params_after']:>10,} "
                  f"({rep['params_after'] / rep['params_before']:.2f}x), {which}, "
                  f"loss {rep['held_out_loss_before']:.4f} -> {rep['held_out_loss_after']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
