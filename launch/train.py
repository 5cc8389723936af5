"""Train the reference GPT with tensor (and data) parallelism. From the repository root, after
`make setup` (or `make train` / `make test`) created .venv:

    .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py       # the main job (`make train`)
    .venv/bin/torchrun --standalone --nproc_per_node=4 launch/train.py parallel.tp=2 parallel.dp=2 precision=bf16
    .venv/bin/python launch/train.py trainer.max_steps=50                    # one process, no process group
    .venv/bin/python launch/train.py trainer.run_dir=outputs/a trainer.max_steps=100   # resume / extend outputs/a
    .venv/bin/python launch/train.py --multirun parallel.tp=1 optim.lr=1e-3,3e-4       # a Hydra sweep

Options: conf/ (one folder per group), documented in bigdense/config.py. Everything a run writes
goes to its run directory (trainer.run_dir, or a new one under outputs/): metrics.jsonl,
loss_curve.png, checkpoints/, train_rank*.log.
"""
import logging
import math
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

import bigdense as bd
from bigdense.config import ConfigError, check_override_keys, register_configs
from bigdense.data import prepare_data
from bigdense.train import EngineSettings, apply_recompute, build_engine
from bigdense.train.checkpointing import RunCheckpoints, train_step_or_diagnose
from bigdense.train.compile import compile_blocks
from bigdense.train.flops import flops_per_token, mfu, peak_tflops
from bigdense.train.faults import BadSteps, CollectiveFailure, TrainingStopped
from bigdense.train.run_setup import HeldStderr, build_gpt, start_run, stop
from bigdense.train.metrics import DenseLayerStats, MetricsLog, StepWindow, peak_memory_gb, plot_loss_curve

log = logging.getLogger("bigdense")
register_configs()


def evaluate(engine, data, ctx, n_batches: int) -> float:
    """Mean held-out loss over a fixed set of batches (the same at every call), averaged over DP."""
    losses = [engine.eval_loss(x, y) for x, y in data.val_batches(n_batches, ctx.dp_rank, ctx.dp_size)]
    return sum(losses) / len(losses)


HOLD = HeldStderr()  # Hydra's own errors printed once under torchrun (by rank 0), like bigdense's


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    HOLD.release()
    try:
        train(cfg)
    except ConfigError as err:  # raised before any training step, normally on every rank alike
        stop(f"bigdense: bad config: {err}", 2)
    except TrainingStopped as err:  # a fault the run cannot continue past
        print(f"bigdense: {err}", file=sys.stderr)
        sys.exit(1)
    except CollectiveFailure as err:  # a peer is gone: exit now, and a launcher with restarts resumes
        print(f"bigdense: {err}", file=sys.stderr, flush=True)  # from `latest`; a background save still
        logging.shutdown()                                        # in flight would wait for the missing
        os._exit(1)                                               # peer, and is safely abandoned


def train(cfg) -> None:
    # 1. Check the config on every rank, then build the TP x DP mesh and seed every generator.
    run = start_run(cfg, HydraConfig.get().runtime.output_dir)
    ctx, tr = run.ctx, cfg.trainer

    # 2. Data: the tokenizer and token arrays are built once (rank 0) and cached.
    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    log.info("data: %s", data.describe())

    # 3. Parallelism, applied in a fixed order: TP (the model is built sharded), torch.compile of
    #    each block, activation checkpointing, then the engine (DP, precision, optimizer, clipping).
    model = build_gpt(cfg.model, data.tokenizer.vocab_size, ctx, cfg.parallel)
    # Weights to start from (trainer.init_from: e.g. a checkpoint of `python -m bigdense.compress`)
    # go into the plain model before an engine takes copies of them (DeepSpeed's fp32 masters); a
    # run directory that has a checkpoint resumes from it instead (step 4).
    resuming = tr.resume and (run.checkpoint_dir / "latest").exists()
    if tr.init_from and not resuming:
        meta = bd.load_checkpoint(tr.init_from, model, load_rng=False)
        log.info("model weights from %s (saved at step %s)", tr.init_from, meta.step)
    if tr.compile:
        compile_blocks(model.blocks, tr.compile_backend)
    apply_recompute(model.blocks, cfg.recompute)
    engine = build_engine(model, ctx, EngineSettings.from_run_config(cfg))
    counts = model.num_parameters()
    log.info("model: %.2fM parameters, head %.2fM; mesh tp=%d x dp=%d on %s; engine=%s precision=%s recompute=%s",
             counts["total"] / 1e6, counts["head"] / 1e6, ctx.tp_size, ctx.dp_size, ctx.device,
             cfg.engine.kind, cfg.precision.dtype, cfg.recompute.mode)

    # 4. Resume from this run directory's last complete checkpoint, if any (a larger max_steps
    #    extends the run).
    ckpts = RunCheckpoints(run.checkpoint_dir, engine, tr, cfg)
    start_step, data_offset = 0, 0
    resumed = ckpts.load_latest() if tr.resume else None
    if resumed is not None:
        start_step, data_offset = resumed
        log.info("resumed from %s at step %d of %d", run.checkpoint_dir / "latest", start_step, tr.max_steps)
        if start_step >= tr.max_steps:
            log.warning("nothing to train: %s is at step %d and trainer.max_steps=%d; extend with a larger "
                        "trainer.max_steps, or start fresh in another trainer.run_dir", run.checkpoint_dir / "latest",
                        start_step, tr.max_steps)

    # 5. The loop. The batch of a step is a pure function of (seed, data position), and the data
    #    position is the step plus an offset that only a rollback past bad batches moves.
    bad_steps = BadSteps(tr.max_bad_steps)
    #    Nothing in a step reads the device on the host (checks off after the first steps; the
    #    engine's results are tensors): skip flags and the interval's numbers are read at the
    #    interval's sync points (log, evaluation, save), so a rollback for bad steps happens there.
    metrics = MetricsLog(run.run_dir, ctx.is_main, tensorboard=tr.tensorboard)
    stats = DenseLayerStats(model, ctx.tp_group) if tr.log_rms else None
    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_len * cfg.data.grad_accum * ctx.dp_size
    bar = tqdm(total=tr.max_steps, initial=start_step, disable=not (ctx.is_main and tr.progress_bar),
               dynamic_ncols=True, desc="train")
    flops_token = flops_per_token(counts["total"], cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len)
    peak = peak_tflops(ctx.device, tr.peak_tflops)
    explicit_checks = os.environ.get("BIGDENSE_CHECKS") is not None  # the user's word wins
    window = StepWindow()
    step = start_step
    while step < tr.max_steps:
        step += 1
        pos = step + data_offset
        micro_batches = [data.train_batch(pos, m, ctx.dp_rank, ctx.dp_size) for m in range(cfg.data.grad_accum)]
        log_now = step % tr.log_interval == 0 or step == tr.max_steps
        eval_now = bool(tr.eval_interval) and step % tr.eval_interval == 0 and step != tr.max_steps
        save_now = bool(tr.save_interval) and step % tr.save_interval == 0 and step != tr.max_steps
        if stats is not None:
            stats.capture = log_now
        if not explicit_checks:
            bd.set_checks(step <= start_step + tr.checked_steps)
        result = train_step_or_diagnose(engine, micro_batches, ctx, step)
        if stats is not None:
            stats.capture = False  # not through the evaluation that may follow
        window.add(result, step, pos)
        bar.update(1)
        if (log_now or eval_now or save_now) and window.replay(bad_steps):  # one host sync
            step, data_offset = ckpts.rollback(bad_steps)
            bar.reset(total=tr.max_steps)
            bar.update(step)
            window = StepWindow()
            continue
        if log_now:
            step_time = (time.perf_counter() - window.start) / window.steps
            summary = window.read()
            bar.set_postfix(loss=f"{summary['last_loss']:.3f}")
            if summary["skipped_steps"]:
                log.warning("%d of the last %d steps skipped (non-finite loss or gradients; grad norm %s, loss "
                            "scale %s). With host checks off (bd.set_checks), an id or label out of range also "
                            "gives NaN: rerun with BIGDENSE_CHECKS=1 to have it named.", summary["skipped_steps"],
                            window.steps, summary["grad_norm"], summary["loss_scale"])
            tokens_per_s_device = tokens_per_step / step_time / ctx.world_size
            record = {
                "kind": "train", "step": step, **summary, "tokens_per_s": tokens_per_step / step_time,
                "tokens_per_s_per_device": tokens_per_s_device, "mfu": mfu(tokens_per_s_device, flops_token, peak),
                "step_time_s": step_time, "peak_mem_gb": peak_memory_gb(ctx.device),
            }
            if stats is not None:
                record.update(stats.collect())
            metrics.write(record)
            if ctx.is_main:
                util = f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
                bar.write(f"step {step:5d} | loss {record['loss']:.4f} | grad norm {record['grad_norm']:.3f} | "
                          f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | "
                          f"{step_time * 1e3:.0f} ms/step{util} | peak mem {record['peak_mem_gb']:.2f} GB")
        if eval_now:
            eval_loss = evaluate(engine, data, ctx, tr.eval_batches)
            metrics.write({"kind": "eval", "step": step, "eval_loss": eval_loss})
            if ctx.is_main:
                bar.write(f"step {step:5d} | held-out loss {eval_loss:.4f}")
        if save_now:
            ckpts.save(step, data_offset)
        if log_now:  # evaluation and saving stay out of the next interval's step time
            window = StepWindow()
    bar.close()

    # 6. The final checkpoint, a held-out evaluation, the loss curve.
    if start_step < tr.max_steps:
        ckpts.save(tr.max_steps, data_offset)
    ckpts.settle()
    eval_loss = evaluate(engine, data, ctx, tr.eval_batches)
    metrics.write({"kind": "eval", "step": tr.max_steps, "eval_loss": eval_loss})
    log.info("held-out loss %.4f (perplexity %.1f) after %d steps", eval_loss, math.exp(min(eval_loss, 50)), tr.max_steps)
    metrics.close()
    if ctx.is_main and tr.plot:
        png = plot_loss_curve(metrics.path, Path(run.run_dir) / "loss_curve.png")
        log.info("metrics: %s; loss curve: %s; checkpoints: %s", metrics.path, png, run.checkpoint_dir)
    bd.destroy_parallel()


if __name__ == "__main__":
    # The deepspeed launcher passes --local_rank=N; Hydra only takes key=value overrides, and
    # LOCAL_RANK is in the environment anyway.
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
    try:  # before Hydra, whose answer to a misspelt key is a hint to add it with `+`
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        stop(f"bigdense: bad config: {err}", 2)
    with HOLD:
        main()
