"""Train the reference GPT, or fine-tune a Hugging Face causal LM, with tensor (and data)
parallelism. From the repository root, after `make setup` (or `make train` / `make test`) created .venv:

    .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py       # the main job (`make train`)
    .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py model=hf model.path=DIR optim=finetune
    .venv/bin/torchrun --standalone --nproc_per_node=4 launch/train.py parallel.tp=2 parallel.dp=2 precision=bf16
    .venv/bin/python launch/train.py trainer.max_steps=50                    # one process, no process group
    .venv/bin/python launch/train.py trainer.run_dir=outputs/a trainer.max_steps=100   # resume / extend outputs/a
    .venv/bin/python launch/train.py --multirun parallel.tp=1 optim.lr=1e-3,3e-4       # a Hydra sweep

Options: conf/ (one folder per group), documented in bigdense/config/schema.py. Everything a run writes
goes to its run directory (trainer.run_dir, or a new one under outputs/): metrics.jsonl,
loss_curve.png, checkpoints/, train_rank*.log, and tensorboard/ with trainer.tensorboard=true.
"""
import logging
import math

import hydra
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

import bigdense as bd
from bigdense.config import register_configs
from bigdense.data import prepare_data
from bigdense.jobs import build_gpt, build_hf, model_tokenizer, parallelize_model, start_run
from bigdense.jobs.parallelize import adapters_wanted
from bigdense.jobs.evaluate import held_out_loss
from bigdense.jobs.loop import StepLoop
from bigdense.jobs.run import launch, run_job
from bigdense.compression.prune_schedule import GradualPruning
from bigdense.train.checkpointing import RunCheckpoints
from bigdense.train.faults import train_step_or_diagnose
from bigdense.train.flops import flops_per_token, mfu, peak_tflops
from bigdense.train.histograms import DenseLayerHistograms
from bigdense.train.metrics import DenseLayerStats, MetricsLog, peak_memory_gb, plot_loss_curve

log = logging.getLogger("bigdense")
register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    run_job(train, cfg)


def train(cfg) -> None:
    # 1. Check the config on every rank, then build the TP x DP mesh and seed every generator.
    run = start_run(cfg, HydraConfig.get().runtime.output_dir)
    ctx, tr = run.ctx, cfg.trainer

    # 2. Data: the tokenizer (model=hf: the model's own) and token arrays are built once (rank 0) and cached.
    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed, tokenizer=model_tokenizer(cfg))
    log.info("data: %s", data.describe())

    # 3. The model: the GPT sharded over TP as it is built, or (model=hf) the Hugging Face model on
    #    the meta device, converted by its own plan. Then parallelism in a fixed order
    #    (`bigdense.jobs.parallelize`): starting weights (trainer.init_from, or model.path's, each
    #    rank reading its shards, into the plain model before an engine copies them; a run
    #    directory with a checkpoint resumes from it instead, step 4), torch.compile of each
    #    block, activation checkpointing, the engine.
    resuming = tr.resume and (run.checkpoint_dir / "latest").exists()
    if cfg.model.name == "hf":
        model = build_hf(cfg, keep_files_in=run.hf_dir if ctx.is_main else None)
    else:
        model = build_gpt(cfg, data.tokenizer.vocab_size, ctx)
    base_again = adapters_wanted(cfg)  # a LoRA run's checkpoints hold its adapters, not its frozen base
    engine = parallelize_model(model, ctx, cfg, init_from=tr.init_from if base_again or not resuming else None,
                               load_pretrained=base_again or not resuming).engine
    counts = model.num_parameters()
    log.info("model: %.2fM parameters, head %.2fM; mesh tp=%d x dp=%d on %s; engine=%s precision=%s recompute=%s",
             counts["total"] / 1e6, counts["head"] / 1e6, ctx.tp_size, ctx.dp_size, ctx.device,
             cfg.engine.kind, cfg.precision.dtype, cfg.recompute.mode)

    # 4. Resume from this run directory's last complete checkpoint, if any (a larger max_steps
    #    extends the run). Gradual pruning (the prune group) gives its layers masks first, which
    #    the checkpoint restores.
    pruner = GradualPruning(model, cfg.prune)
    ckpts = RunCheckpoints(run.checkpoint_dir, engine, tr, cfg)
    start_step, data_offset = ckpts.resume()

    # 5. The loop (`bigdense.jobs.loop`): a step's batch is a pure function of (seed, data
    #    position); nothing in a step reads the device on the host, so outcomes are read at the
    #    interval's sync points (log, evaluation, save), where a run of bad steps rolls back.
    metrics = MetricsLog(run.run_dir, ctx.is_main, tensorboard=tr.tensorboard)
    bar = tqdm(total=tr.max_steps, initial=start_step, disable=not (ctx.is_main and tr.progress_bar),
               dynamic_ncols=True, desc="train")
    loop = StepLoop(tr, ckpts, start_step, data_offset, bar)
    if loop.trained:  # the loss curve marks a resume, and its title names every layout of the run
        metrics.write_launch(start_step, run.layout)
    stats = DenseLayerStats(model, ctx.tp_group) if tr.log_rms else None
    histograms = DenseLayerHistograms(model, ctx.tp_group) if tr.tensorboard and tr.log_histograms else None
    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * ctx.dp_size
    flops_token = flops_per_token(counts["total"], *model.depth_and_width(), cfg.data.seq_len)
    peak = peak_tflops(ctx.device, tr.peak_tflops)
    for step in loop:
        micro_batches = [data.train_batch(step.pos, m, ctx.dp_rank, ctx.dp_size) for m in range(cfg.data.grad_accum)]
        if stats is not None:
            stats.capture = step.log
        pruner.before_step(step.number)  # at the schedule's events only
        result = train_step_or_diagnose(engine, micro_batches, ctx, step.number)
        if stats is not None:
            stats.capture = False  # not through the evaluation that may follow
        if loop.record(step, result):  # rolled back past bad steps
            continue
        if step.log:
            steps, step_time, summary = loop.interval()
            bar.set_postfix(loss=f"{summary['last_loss']:.3f}")
            if summary["skipped_steps"]:
                log.warning("%d of the last %d steps skipped (non-finite loss or gradients; grad norm %s, loss "
                            "scale %s). With host checks off (bd.set_checks), an id or label out of range also "
                            "gives NaN: rerun with BIGDENSE_CHECKS=1 to have it named.", summary["skipped_steps"],
                            steps, summary["grad_norm"], summary["loss_scale"])
            tokens_per_s_device = tokens_per_step / step_time / ctx.world_size
            # Records mask prompts and padding: the same counts over the tokens that are targets.
            targets_per_s_device = summary["target_tokens"] / (steps * step_time) / ctx.world_size
            record = {
                "kind": "train", "step": step.number, **summary, "tokens_per_s": tokens_per_step / step_time,
                "tokens_per_s_per_device": tokens_per_s_device, "mfu": mfu(tokens_per_s_device, flops_token, peak),
                "target_tokens_per_s": targets_per_s_device * ctx.world_size,
                "target_mfu": mfu(targets_per_s_device, flops_token, peak),
                "step_time_s": step_time, "peak_mem_gb": peak_memory_gb(ctx.device),
            }
            if stats is not None:
                record.update(stats.collect())
            metrics.write(record)
            if histograms is not None:  # a collective: every rank, on logging steps only
                metrics.write_histograms(histograms.collect(), step.number)
            if ctx.is_main:
                util = f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
                if record["target_tokens_per_s"] < 0.999 * record["tokens_per_s"]:  # some tokens are masked
                    util += f" | {record['target_tokens_per_s']:,.0f} target tok/s"
                bar.write(f"step {step.number:5d} | loss {record['loss']:.4f} | grad norm {record['grad_norm']:.3f} | "
                          f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | "
                          f"{step_time * 1e3:.0f} ms/step{util} | peak mem {record['peak_mem_gb']:.2f} GB")
        if step.eval:
            eval_loss = held_out_loss(engine.eval_loss_and_tokens, data, ctx, tr.eval_batches)
            metrics.write({"kind": "eval", "step": step.number, "eval_loss": eval_loss})
            if ctx.is_main:
                bar.write(f"step {step.number:5d} | held-out loss {eval_loss:.4f}")
        if step.save:
            loop.save(step)
        loop.end_of(step)
    bar.close()

    # 6. The final checkpoint, a held-out evaluation, the loss curve (a launch with nothing left
    #    to train adds none of them).
    loop.finish()
    if loop.trained:
        eval_loss = held_out_loss(engine.eval_loss_and_tokens, data, ctx, tr.eval_batches)
        metrics.write({"kind": "eval", "step": tr.max_steps, "eval_loss": eval_loss})
        log.info("held-out loss %.4f (perplexity %.1f) after %d steps", eval_loss, math.exp(min(eval_loss, 50)),
                 tr.max_steps)
    metrics.close()
    if ctx.is_main and loop.trained:
        png = plot_loss_curve(metrics.path, run.run_dir / "loss_curve.png", title=run.label(cfg)) if tr.plot else None
        log.info(run.describe_outputs([metrics.path, png], metrics.tensorboard_dir))
    bd.destroy_parallel()


if __name__ == "__main__":
    launch(main)
