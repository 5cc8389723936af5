"""Train a many-class classifier: which file of this Python's standard library a window of tokens comes from.

    torchrun --standalone --nproc_per_node=2 launch/classify.py                   # `make classify`: tp=2
    torchrun --standalone --nproc_per_node=2 launch/classify.py parallel.tp=1 head=partial_fc   # world-sharded
    torchrun --standalone --nproc_per_node=2 launch/classify.py head.sample_rate=0.3 head.margin=cosface
    python launch/classify.py trainer.max_steps=50                                 # one process

Every training file of the corpus (`bigdense.data.FileWindows`) is a class; the model is the
reference transformer's blocks, mean-pooled, and a `ParallelClassifierHead` with the ``head`` group's
options. The same config groups as `launch/train.py` (conf/, documented in bigdense/config/schema.py) plus
``head``. The run directory gets metrics.jsonl (held-out loss, top-1 and top-5 accuracy),
loss_curve.png, checkpoints/ and one log per rank.
"""
import logging

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

import bigdense as bd
from bigdense.config import register_configs
from bigdense.data import FileWindows, prepare_data
from bigdense.errors import ConfigError
from bigdense.jobs import build_text_classifier, parallelize_model, start_run
from bigdense.jobs.loop import StepLoop
from bigdense.jobs.run import launch, run_job
from bigdense.parallel import comm
from bigdense.train.checkpointing import RunCheckpoints
from bigdense.train.faults import train_step_or_diagnose
from bigdense.train.metrics import MetricsLog, peak_memory_gb, plot_loss_curve
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
    run_job(train, cfg)


def train(cfg) -> None:
    # 1. Check the config on every rank, build the TP x DP mesh, seed every generator.
    run = start_run(cfg, HydraConfig.get().runtime.output_dir)
    ctx, tr = run.ctx, cfg.trainer

    # 2. Data: the GPT job's tokenized corpus (cached), each training file a class.
    if cfg.data.source == "records":
        raise ConfigError("launch/classify.py learns which file a window of text comes from (data=stdlib or data=files); "
                          "data=records fine-tunes a causal LM with launch/train.py")
    data = prepare_data(cfg.data, ctx, seed=tr.seed)
    task = FileWindows.from_tokens(data.train_tokens, data.tokenizer.eot_id, seq_len=cfg.data.seq_len,
                                   micro_batch_size=cfg.data.micro_batch_size, seed=tr.seed)
    log.info("data: %s; task: %s", data.describe(), task.describe())

    # 3. The model, sharded as it is built (the head over TP or every rank), then parallelism in
    #    the fixed order of `bigdense.jobs.parallelize`: starting weights, compile, activation
    #    checkpointing, the engine.
    resuming = tr.resume and (run.checkpoint_dir / "latest").exists()
    model = build_text_classifier(cfg, data.tokenizer.vocab_size, task.num_classes, ctx)
    engine = parallelize_model(model, ctx, cfg, init_from=None if resuming else tr.init_from).engine
    log.info("model: %s classes, head %s; mesh tp=%d x dp=%d on %s; engine=%s precision=%s",
             task.num_classes, model.head.extra_repr(), ctx.tp_size, ctx.dp_size, ctx.device,
             cfg.engine.kind, cfg.precision.dtype)

    # 4. Resume from this run directory's last complete checkpoint, if any.
    ckpts = RunCheckpoints(run.checkpoint_dir, engine, tr, cfg)
    start_step, data_offset = ckpts.resume()

    def held_out(step: int, bar) -> None:
        result = evaluate(engine, task, ctx, cfg.precision.dtype, tr.eval_batches)
        metrics.write({"kind": "eval", "step": step, **result})
        if ctx.is_main:
            bar.write(f"step {step:5d} | held-out loss {result['eval_loss']:.4f} | top-1 {result['top1']:.1%} | "
                      f"top-5 {result['top5']:.1%}")

    # 5. The loop, as in launch/train.py (`bigdense.jobs.loop`: data positions, sync points,
    #    rollback past bad steps).
    metrics = MetricsLog(run.run_dir, ctx.is_main, tensorboard=tr.tensorboard)
    bar = tqdm(total=tr.max_steps, initial=start_step, disable=not (ctx.is_main and tr.progress_bar),
               dynamic_ncols=True, desc="classify")
    loop = StepLoop(tr, ckpts, start_step, data_offset, bar)
    if loop.trained:  # the plot marks a resume, and its title names every layout of the run
        metrics.write_launch(start_step, run.layout)
    for step in loop:
        micro_batches = [task.train_batch(step.pos, m, ctx.dp_rank, ctx.dp_size) for m in range(cfg.data.grad_accum)]
        if loop.record(step, train_step_or_diagnose(engine, micro_batches, ctx, step.number)):
            continue  # rolled back past bad steps
        if step.log:
            steps, step_time, summary = loop.interval()
            bar.set_postfix(loss=f"{summary['last_loss']:.3f}")
            if summary["skipped_steps"]:
                log.warning("%d of the last %d steps skipped (non-finite loss or gradients)", summary["skipped_steps"],
                            steps)
            record = {"kind": "train", "step": step.number, **summary, "step_time_s": step_time,
                      "samples_per_s": cfg.data.micro_batch_size * cfg.data.grad_accum * ctx.dp_size / step_time,
                      "peak_mem_gb": peak_memory_gb(ctx.device)}
            metrics.write(record)
            if ctx.is_main:
                bar.write(f"step {step.number:5d} | loss {record['loss']:.4f} | grad norm {record['grad_norm']:.3f} | "
                          f"lr {record['lr']:.2e} | {record['samples_per_s']:,.0f} windows/s | "
                          f"{step_time * 1e3:.0f} ms/step | peak mem {record['peak_mem_gb']:.2f} GB")
        if step.eval:
            held_out(step.number, bar)
        if step.save:
            loop.save(step)
        loop.end_of(step)
    bar.close()

    # 6. The final checkpoint, held-out accuracy, the loss and accuracy curves (a launch with
    #    nothing left to train adds none of them).
    loop.finish()
    if loop.trained:
        held_out(tr.max_steps, tqdm)
    metrics.close()
    if ctx.is_main and loop.trained:
        png = plot_loss_curve(metrics.path, run.run_dir / "loss_curve.png", title=run.label(cfg),
                              loss_unit="nats/window", accuracy=True) if tr.plot else None
        log.info(run.describe_outputs([metrics.path, png], metrics.tensorboard_dir))
    bd.destroy_parallel()


if __name__ == "__main__":
    launch(main)
