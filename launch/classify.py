"""Train a many-class classifier: which file of this Python's standard library a window of tokens comes from.

    torchrun --standalone --nproc_per_node=2 launch/classify.py                   # `make classify`: tp=2
    torchrun --standalone --nproc_per_node=2 launch/classify.py parallel.tp=1 head=partial_fc   # world-sharded
    torchrun --standalone --nproc_per_node=2 launch/classify.py head.sample_rate=0.3 head.margin=cosface
    python launch/classify.py trainer.max_steps=50                                 # one process

Every training file of the corpus (`bigdense.data.FileWindows`) is a class; the model is the
reference transformer's blocks, mean-pooled, and a `ParallelClassifierHead` with the ``head`` group's
options. The same config groups as `launch/train.py` (conf/, documented in bigdense/config.py) plus
``head``. The run directory gets metrics.jsonl (held-out loss, top-1 and top-5 accuracy),
loss_curve.png, checkpoints/ and one log per rank.
"""
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

import bigdense as bd
from bigdense.config import ConfigError, register_configs
from bigdense.data import FileWindows, prepare_data
from bigdense.models import GPTConfig, TextClassifier
from bigdense.parallel import comm
from bigdense.train import EngineSettings, apply_recompute, build_engine
from bigdense.train.run_setup import launcher_world, start_run
from bigdense.train.metrics import MetricsLog, StepWindow, peak_memory_gb, plot_loss_curve
from bigdense.train.precision import autocast

log = logging.getLogger("bigdense")
register_configs()


def evaluate(engine, task, ctx, precision: str, n_batches: int) -> dict:
    """Held-out loss and top-1 / top-5 accuracy over a fixed set of windows, over every DP rank."""
    model, losses, hits = engine.model, [], torch.zeros(2, dtype=torch.float64)
    batches = task.val_batches(n_batches, ctx.dp_rank, ctx.dp_size)
    for x, y in batches:
        losses.append(engine.eval_loss(x, y))
        was_training = model.training
        model.eval()
        with torch.no_grad(), autocast(precision, ctx.device):
            _, top = model.predict(x.to(ctx.device), k=min(5, task.num_classes))
        model.train(was_training)
        top = top.cpu()
        hits += torch.tensor([(top[:, 0] == y).sum().item(), (top == y[:, None]).any(1).sum().item()])
    hits = comm.all_reduce_(hits.to(ctx.device), ctx.dp_group).cpu()
    seen = len(batches) * task.micro_batch_size * ctx.dp_size
    return {"eval_loss": sum(losses) / len(losses), "top1": hits[0].item() / seen, "top5": hits[1].item() / seen}


@hydra.main(config_path="../conf", config_name="classify", version_base="1.3")
def main(cfg) -> None:
    try:
        train(cfg)
    except ConfigError as err:  # raised before any training step, on every rank alike
        rank = launcher_world()[0]
        if rank != 0:
            time.sleep(10)  # rank 0 prints; torchrun stops the others meanwhile
        print(f"bigdense: bad config{f' (rank {rank})' if rank else ''}: {err}", file=sys.stderr)
        sys.exit(2)


def train(cfg) -> None:
    # 1. Check the config on every rank, build the TP x DP mesh, seed every generator.
    run = start_run(cfg, HydraConfig.get().runtime.output_dir)
    ctx, tr = run.ctx, cfg.trainer

    # 2. Data: the GPT job's tokenized corpus (cached), each training file a class.
    data = prepare_data(cfg.data, ctx, seed=tr.seed)
    task = FileWindows.from_tokens(data.train_tokens, data.tokenizer.eot_id, seq_len=cfg.data.seq_len,
                                   micro_batch_size=cfg.data.micro_batch_size, seed=tr.seed)
    log.info("data: %s; task: %s", data.describe(), task.describe())

    # 3. Parallelism in a fixed order: TP (the model is built sharded, the head over TP or every
    #    rank), activation checkpointing, then the engine (DP, precision, optimizer, clipping).
    head = cfg.head
    margin = head.margin if head.margin is None or isinstance(head.margin, str) else tuple(head.margin)
    with torch.device(ctx.device):
        model = TextClassifier(GPTConfig.from_config(cfg.model, data.tokenizer.vocab_size), task.num_classes,
                               tp_group=ctx.tp_group, dp_group=ctx.dp_group, shard=head.shard,
                               sample_rate=head.sample_rate, margin=margin, scale=head.scale)
    apply_recompute(model.blocks, cfg.recompute)
    engine = build_engine(model, ctx, EngineSettings.from_run_config(cfg))
    log.info("model: %s classes, head %s; mesh tp=%d x dp=%d on %s; engine=%s precision=%s",
             task.num_classes, model.head.extra_repr(), ctx.tp_size, ctx.dp_size, ctx.device,
             cfg.engine.kind, cfg.precision.dtype)

    # 4. Resume from this run directory's last complete checkpoint, if any.
    start_step = 0
    if tr.resume and (run.checkpoint_dir / "latest").exists():
        start_step = bd.load_checkpoint(run.checkpoint_dir / "latest", **engine.checkpoint_state()).step
        log.info("resumed at step %d", start_step)

    def save(step: int) -> None:
        bd.save_checkpoint(run.checkpoint_dir / f"step_{step:07d}", **engine.checkpoint_state(), step=step,
                           config=cfg)

    def held_out(step: int, bar) -> None:
        result = evaluate(engine, task, ctx, cfg.precision.dtype, tr.eval_batches)
        metrics.write({"kind": "eval", "step": step, **result})
        if ctx.is_main:
            bar.write(f"step {step:5d} | held-out loss {result['eval_loss']:.4f} | top-1 {result['top1']:.1%} | "
                      f"top-5 {result['top5']:.1%}")

    # 5. The loop: a step's batch is a pure function of (seed, step).
    metrics = MetricsLog(run.run_dir, ctx.is_main)
    bar = tqdm(total=tr.max_steps, initial=start_step, disable=not (ctx.is_main and tr.progress_bar),
               dynamic_ncols=True, desc="classify")
    explicit_checks = os.environ.get("BIGDENSE_CHECKS") is not None  # the user's word wins
    window = StepWindow()
    for step in range(start_step + 1, tr.max_steps + 1):
        micro_batches = [task.train_batch(step, m, ctx.dp_rank, ctx.dp_size) for m in range(cfg.data.grad_accum)]
        if not explicit_checks:
            bd.set_checks(step <= start_step + tr.checked_steps)  # label range checks sync; a few steps suffice
        window.add(engine.train_step(micro_batches), step, step)
        bar.update(1)
        if step % tr.log_interval == 0 or step == tr.max_steps:
            step_time = (time.perf_counter() - window.start) / window.steps
            summary = window.read()  # the interval's one host read
            bar.set_postfix(loss=f"{summary['last_loss']:.3f}")
            record = {"kind": "train", "step": step, "loss": summary["loss"], "grad_norm": summary["grad_norm"],
                      "lr": summary["lr"], "step_time_s": step_time,
                      "samples_per_s": cfg.data.micro_batch_size * cfg.data.grad_accum * ctx.dp_size / step_time,
                      "peak_mem_gb": peak_memory_gb(ctx.device), "skipped": summary["skipped"],
                      "skipped_steps": summary["skipped_steps"]}
            metrics.write(record)
            if ctx.is_main:
                bar.write(f"step {step:5d} | loss {record['loss']:.4f} | grad norm {record['grad_norm']:.3f} | "
                          f"lr {record['lr']:.2e} | {record['samples_per_s']:,.0f} windows/s | "
                          f"{step_time * 1e3:.0f} ms/step | peak mem {record['peak_mem_gb']:.2f} GB")
        if tr.eval_interval and step % tr.eval_interval == 0 and step != tr.max_steps:
            held_out(step, bar)
        if tr.save_interval and step % tr.save_interval == 0 and step != tr.max_steps:
            save(step)
        if step % tr.log_interval == 0:  # evaluation and saving stay out of the next interval's step time
            window = StepWindow()
    bar.close()

    # 6. The final checkpoint, held-out accuracy, the loss curve.
    if start_step < tr.max_steps:
        save(tr.max_steps)
    held_out(tr.max_steps, tqdm)
    metrics.close()
    if ctx.is_main and tr.plot:
        png = plot_loss_curve(metrics.path, Path(run.run_dir) / "loss_curve.png")
        log.info("metrics: %s; loss curve: %s; checkpoints: %s", metrics.path, png, run.checkpoint_dir)
    bd.destroy_parallel()


if __name__ == "__main__":
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]  # the deepspeed launcher's
    main()
