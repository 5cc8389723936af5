"""Low-rank adapters against full fine-tuning: what each rank holds and its peak in a training step.

    python -m bigdense.bench.lora                       # Llama-shaped ~53M, tp=2 on 2 CPU processes: ~2 min
    python -m bigdense.bench.lora --d 256 --layers 2 --json lora.jsonl    # a quick look

The named configuration: a Llama-shaped model written by ``save_pretrained`` (random weights;
``--d`` 512, ``--layers`` 8, 8 heads over 4 key/value heads, MLP ``--ffn`` 1,408, vocabulary
``--vocab`` 32,000, fp32), fine-tuned by the job's own code (`build_hf`, `parallelize_model`: the
directory's weights read shard by shard, the DDP engine, fused AdamW, clipping) at tp=2 on 2
gloo processes, ``--batch`` 4 rows of ``--seq`` 256 tokens. Baseline: full fine-tuning
(``lora.r=0``); against it, adapters of rank ``--r`` on every attention and MLP projection
(``lora=adapters``: targets all-linear, alpha 2r, no dropout).

Per rank, after a first step (the optimizer state exists), counted from the tensors themselves:
parameters, trainable parameters, the gradients held, AdamW's state; the peak of live tensor bytes
within a step (`bigdense.plan.measure.measure_step_peak`, the least of 3 steps) and the memory
planner's estimate of it (`python -m bigdense.plan` with the same overrides); and the step time
(median of ``--iters``). Ratios are LoRA / full, measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import append_json_lines

MODES = {"full": ["lora=none"], "lora": ["lora=adapters"]}


def _overrides(args, model_dir: Path, mode: str) -> list[str]:
    return ["model=hf", f"model.path={model_dir}", f"parallel.tp={args.tp}", f"data.seq_len={args.seq}",
            f"data.micro_batch_size={args.batch}", "optim=finetune", *MODES[mode],
            *([f"lora.r={args.r}", f"lora.alpha={2 * args.r}"] if mode == "lora" else [])]


def _rank(overrides: list[str], iters: int) -> dict:
    """One rank of the job's fine-tune: the counted bytes, the peak within a step, the step time."""
    import bigdense as bd
    from ..jobs import build_hf, parallelize_model
    from ..plan.__main__ import DEFAULT_CONF, compose
    from ..plan.measure import measure_step_peak, optimizer_tensors

    cfg = compose(overrides, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=int(cfg.parallel.tp))
    torch.manual_seed(0)
    model = build_hf(cfg)
    engine = parallelize_model(model, ctx, cfg).engine
    vocab, b, s = model.text_config().vocab_size, cfg.data.micro_batch_size, cfg.data.seq_len
    g = torch.Generator().manual_seed(1)
    batch = [(torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g))]
    engine.train_step(batch)
    peak = min(measure_step_peak(lambda: engine.train_step(batch), model, engine.optimizer, ctx.device)["peak_bytes"]
               for _ in range(3))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        engine.train_step(batch).loss  # reading the loss waits for the step
        times.append(time.perf_counter() - start)
    params = list(model.parameters())
    return {
        "params_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_params": bd.layers.base.global_numel(model, trainable_only=True),
        "total_params": bd.layers.base.global_numel(model),
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in optimizer_tensors(engine.optimizer)),
        "peak_bytes": peak, "step_s": statistics.median(times),
    }


def _planned_peak(overrides: list[str]) -> float:
    """The memory planner's peak per rank for the same job (bytes)."""
    from ..plan.__main__ import DEFAULT_CONF, compose
    from ..plan.config import estimate_config
    from ..config import PlanConfig
    from omegaconf import OmegaConf

    plan = OmegaConf.structured(PlanConfig(device_type="cpu"))
    return float(estimate_config(compose(overrides, DEFAULT_CONF), plan).peak_bytes)


def run(args) -> list[dict]:
    from ..testing import run_ranks
    from ..testing.pretrained import write_pretrained

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_pretrained(
            Path(tmp) / "llama", "llama", vocab_size=args.vocab, hidden_size=args.d, intermediate_size=args.ffn,
            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.d // 8,
            max_position_embeddings=max(512, args.seq))
        for mode in MODES:
            overrides = _overrides(args, model_dir, mode)
            per_rank = run_ranks(_rank, args.tp, overrides, args.iters, timeout=1800, init_process_group=True)
            row = {"mode": mode, "tp": args.tp, "d": args.d, "layers": args.layers, "ffn": args.ffn,
                   "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "r": args.r if mode == "lora" else 0,
                   **{k: max(r[k] for r in per_rank) for k in per_rank[0]},
                   "planned_peak_bytes": _planned_peak(overrides)}
            rows.append(row)
    return rows


def report(rows: list[dict]) -> None:
    full, lora = rows
    mib = 2 ** 20
    print(f"Llama-shaped d={full['d']} x {full['layers']} layers, MLP {full['ffn']}, vocab {full['vocab']}: "
          f"{full['total_params'] / 1e6:.1f}M parameters; tp={full['tp']}, {full['batch']} x {full['seq']} tokens, fp32")
    print(f"{'per rank':<28}{'full fine-tune':>16}{'LoRA r=' + str(lora['r']):>16}{'LoRA / full':>14}")
    lines = [("trainable parameters", "trainable_params", 1e6, "M"), ("parameters", "params_bytes", mib, " MiB"),
             ("gradients", "grad_bytes", mib, " MiB"), ("AdamW state", "optimizer_bytes", mib, " MiB"),
             ("peak in a step (measured)", "peak_bytes", mib, " MiB"),
             ("peak (memory planner)", "planned_peak_bytes", mib, " MiB"), ("step time", "step_s", 1e-3, " ms")]
    for label, key, unit, suffix in lines:
        a, b = full[key] / unit, lora[key] / unit
        print(f"{label:<28}{a:>12,.2f}{suffix:<4}{b:>12,.2f}{suffix:<4}{(b / a if a else 0):>10.3f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bigdense.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = run(args)
    report(rows)
    if args.json:
        append_json_lines(args.json, rows)


if __name__ == "__main__":
    main()
