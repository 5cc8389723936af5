"""Sparse products and int8 weights against the dense layer on CPU; rows pruning of the reference GPT.

    python -m bigdense.bench.sparse                        # both parts (27 minutes on 2 loaded cores, most of it part 2)
    python -m bigdense.bench.sparse --skip-gpt --tokens 1 16 128 512
    python -m bigdense.bench.sparse --quick                # small shapes, a tiny GPT: seconds (the test's)

Part 1, Fast R-CNN's fc6 (25,088 -> 4,096) and fc7 (4,096 -> 4,096) shapes, weights drawn N(0, 1/in)
(no pretrained VGG is downloaded), one process with ``--threads`` threads. Forward time of
``--tokens`` rows (RoI heads see ~128-512) through:

* ``dense``: the ``nn.Linear``, fp32 (the baseline of every ratio, at the same token count: the
  layer one would otherwise run);
* ``csr-90``, ``csr-95``: the layer `bd.prune`'d (unstructured) to 90% / 95% and its `bd.SparseLinear`;
* ``int8``: `bd.Int8Linear`, fp32 activations (the int8 weight converted a tile at a time);
* ``dense-bf16`` and ``int8-bf16``: bf16 activations, the bf16 layer and the int8 one (torch's
  fused ``_weight_int8pack_mm``);
* ``dynamic``: ``torch.ao.quantization.quantize_dynamic``, the tool the guides teach (int8 weights
  per tensor AND activations quantised on the fly: not weight-only), for reference.

Median of ``--iters`` after a warm-up. Error: ``||y - y_ref|| / ||y_ref||``, ``y_ref`` the fp32
output of what the contender stands for -- the masked dense layer for CSR (the product's own
rounding), the float layer for the others (quantisation and bf16). The pruning's own error (of the
weight, ``||W - W*mask|| / ||W||``) is printed once per sparsity; on these random weights it says
nothing of a trained layer's.

Part 2: the reference GPT (the main job's config, ``model=gpt_tiny`` on the standard library, its
seed) trained ``--train-steps`` steps at tp=2 (gloo ranks; the job's data, engine and AdamW, data
positions from 0 where the job's start at 1), its
MLPs' hidden units pruned by ``--fraction`` (`bd.prune`, ``structure="rows"``), then trained
``--finetune-steps`` more; beside it, the unpruned model trained the same further steps on the same
batches with a fresh optimizer (the control). Printed: parameters, held-out loss (the job's
``trainer.eval_batches`` batches) after training, after pruning, after the fine-tune, and the control's.
"""
from __future__ import annotations

import argparse
import copy
import math
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ..compression.sparse import median_ms
from . import SEED, append_json_lines

FAST_RCNN = (("fc6", 25088, 4096), ("fc7", 4096, 4096))
QUICK_SHAPES = (("fc6/49", 512, 256), ("fc7/16", 256, 256))
SPARSITIES = (0.9, 0.95)
QUICK_GPT = ["data.max_corpus_mb=0.5", "data.vocab_size=512", "data.seq_len=32", "data.micro_batch_size=4",
             "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_chunk_size=64",
             "trainer.eval_batches=2", "optim.warmup_steps=2", "data.val_fraction=0.2"]


# ---- part 1: one layer, every contender ----------------------------------------------------------
def _median_ms(fn, x: torch.Tensor, iters: int) -> float:
    with torch.no_grad():
        return median_ms(fn, x, iters)


def _dense_layer(in_f: int, out_f: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_f, out_f, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f))
        layer.bias.uniform_(-0.1, 0.1, generator=g)
    return layer


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _contenders(dense: nn.Linear) -> list[tuple[str, nn.Module, torch.dtype, nn.Module, dict]]:
    """(name, module, activation dtype, the fp32 module its error is measured against, extras)."""
    import bigdense as bd

    out = [("dense", dense, torch.float32, dense, {})]
    for sparsity in SPARSITIES:
        pruned = copy.deepcopy(dense)
        start = time.perf_counter()
        bd.prune(pruned, sparsity)
        prune_s = time.perf_counter() - start
        w, kept = dense.weight.detach(), pruned.weight.detach()
        extras = {"prune_s": prune_s, "weight_error": float((w - kept).norm() / w.norm())}
        out.append((f"csr-{round(sparsity * 100)}", bd.SparseLinear(pruned), torch.float32, pruned, extras))
    out.append(("int8", bd.Int8Linear(dense), torch.float32, dense, {}))
    out.append(("dense-bf16", copy.deepcopy(dense).to(torch.bfloat16), torch.bfloat16, dense, {}))
    out.append(("int8-bf16", bd.Int8Linear(dense).to(torch.bfloat16), torch.bfloat16, dense, {}))
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(copy.deepcopy(dense)), {nn.Linear},
                                                         dtype=torch.qint8)
    out.append(("dynamic", dynamic, torch.float32, dense, {}))
    return out


def layer_rows(shapes, tokens, iters: int) -> list[dict]:
    rows = []
    for index, (name, in_f, out_f) in enumerate(shapes):
        contenders = _contenders(_dense_layer(in_f, out_f, SEED + index))
        for n in tokens:
            x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(SEED + 100 + n))
            dense_ms = None
            for label, module, dtype, reference, extras in contenders:
                ms = _median_ms(module, x.to(dtype), iters)
                dense_ms = dense_ms or ms  # the first contender is the dense layer
                with torch.no_grad():
                    error = _relative(module(x.to(dtype)), reference(x))
                rows.append({"layer": name, "in": in_f, "out": out_f, "tokens": n, "contender": label, "ms": ms,
                             "speedup": dense_ms / ms, "relative_error": error, **extras})
    return rows


def print_layers(rows: list[dict], threads: int, iters: int) -> None:
    print(f"one layer, fp32 weights (bf16 rows: bf16 activations), 1 process x {threads} thread(s), median of {iters}")
    print(f"  {'layer':<7} {'rows':>5} {'contender':<11} {'ms':>10} {'vs dense':>9} {'rel. error':>10}")
    for r in rows:
        print(f"  {r['layer']:<7} {r['tokens']:>5} {r['contender']:<11} {r['ms']:>10.2f} {r['speedup']:>8.2f}x "
              f"{r['relative_error']:>10.2e}")
    for r in rows:
        if "prune_s" in r and r["tokens"] == rows[0]["tokens"]:
            print(f"  {r['layer']} {r['contender']}: bd.prune took {r['prune_s']:.1f} s; the weight's pruning error "
                  f"||W - W*mask|| / ||W|| = {r['weight_error']:.3f} (random weights)")


# ---- part 2: rows pruning of the reference GPT ---------------------------------------------------
def _train(model, cfg, ctx, data, first: int, steps: int) -> None:
    """``steps`` optimizer steps of ``model`` from data position ``first``, with a fresh engine (the
    job's: DDP, AdamW, its schedule over ``steps``)."""
    from omegaconf import OmegaConf

    from bigdense.train.engines import EngineSettings, build_engine

    settings = EngineSettings.from_run_config(OmegaConf.merge(cfg, {"trainer": {"max_steps": steps}}))
    engine = build_engine(model, ctx, settings)
    for pos in range(first, first + steps):
        engine.train_step([data.train_batch(pos, m, ctx.dp_rank, ctx.dp_size) for m in range(cfg.data.grad_accum)])


def _mlp_params(model) -> int:
    from bigdense.layers.base import global_numel

    return sum(global_numel(block.mlp) for block in model.blocks)


def _gpt_ranks(overrides, train_steps: int, finetune_steps: int, fraction: float) -> dict:
    import bigdense as bd
    from bigdense.compress import held_out_loss
    from bigdense.data import prepare_data
    from bigdense.jobs import build_gpt
    from bigdense.jobs.setup import seed_everything
    from bigdense.plan.__main__ import DEFAULT_CONF, compose

    cfg = compose(overrides, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=2)
    seed_everything(cfg.trainer.seed)  # as the main job: the same initial weights
    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    model = build_gpt(cfg, data.tokenizer.vocab_size, ctx)
    n_eval = cfg.trainer.eval_batches
    start = time.perf_counter()
    _train(model, cfg, ctx, data, 0, train_steps)
    out = {"train_s": time.perf_counter() - start, "params_before": model.num_parameters()["total"],
           "mlp_params_before": _mlp_params(model), "d_hidden_before": model.blocks[0].mlp.d_hidden,
           "loss_trained": held_out_loss(model, cfg, ctx, n_eval)}
    control = build_gpt(cfg, data.tokenizer.vocab_size, ctx)
    control.load_state_dict(model.state_dict())
    start = time.perf_counter()
    bd.prune(model, fraction, "rows", layers=["blocks.*.mlp"])
    out.update(prune_s=time.perf_counter() - start, params_after=model.num_parameters()["total"],
               mlp_params_after=_mlp_params(model), d_hidden_after=model.blocks[0].mlp.d_hidden,
               loss_pruned=held_out_loss(model, cfg, ctx, n_eval))
    _train(model, cfg, ctx, data, train_steps, finetune_steps)
    out["loss_finetuned"] = held_out_loss(model, cfg, ctx, n_eval)
    _train(control, cfg, ctx, data, train_steps, finetune_steps)
    out["loss_control"] = held_out_loss(control, cfg, ctx, n_eval)
    return out


def gpt_row(args) -> dict:
    from bigdense.testing import run_ranks

    overrides = [*(QUICK_GPT if args.quick else []), *args.gpt_overrides]
    row = run_ranks(_gpt_ranks, 2, overrides, args.train_steps, args.finetune_steps, args.fraction,
                    timeout=7200, collective_timeout=3600)[0]
    return {"overrides": overrides, "train_steps": args.train_steps, "finetune_steps": args.finetune_steps,
            "fraction": args.fraction, **row}


def print_gpt(r: dict) -> None:
    print(f"reference GPT ({' '.join(r['overrides']) or 'the main job config'}), tp=2, {r['train_steps']} steps "
          f"({r['train_s']:.0f} s), MLP hidden units pruned by {r['fraction']:.0%} (bd.prune rows, {r['prune_s']:.2f} s):")
    print(f"  d_hidden {r['d_hidden_before']} -> {r['d_hidden_after']}; MLP parameters {r['mlp_params_before']:,} -> "
          f"{r['mlp_params_after']:,}; all parameters {r['params_before']:,} -> {r['params_after']:,}")
    print(f"  held-out loss: trained {r['loss_trained']:.4f}, pruned {r['loss_pruned']:.4f}, after "
          f"{r['finetune_steps']} steps of fine-tuning {r['loss_finetuned']:.4f} (the unpruned model after the same "
          f"steps: {r['loss_control']:.4f})")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128], help="rows per forward")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of part 1's process")
    parser.add_argument("--train-steps", type=int, default=200, help="part 2: steps before pruning (the main job's)")
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.5, help="part 2: the fraction of hidden units pruned")
    parser.add_argument("--gpt-overrides", nargs="*", default=[], help="part 2: Hydra overrides of the job config")
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="small layers, 1 and 16 rows, 2 iterations; a tiny GPT, 4 + 2 steps (a smoke test)")
    parser.add_argument("--json", type=Path, help="append one JSON object per result")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.iters, args.train_steps, args.finetune_steps = [1, 16], 2, 4, 2
    torch.set_num_threads(args.threads)

    rows = layer_rows(QUICK_SHAPES if args.quick else FAST_RCNN, args.tokens, args.iters)
    print_layers(rows, args.threads, args.iters)
    if not args.skip_gpt:
        gpt = gpt_row(args)
        print_gpt(gpt)
        rows.append({"part": "gpt", **gpt})
    if args.json:
        append_json_lines(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
