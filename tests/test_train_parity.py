"""Layout-independent training: 20 steps of the reference GPT (fp32, dropout on) give the same losses at
tp=1, tp=2, tp=2 x dp=2 (DDP) and DeepSpeed ZeRO-1 at tp=2.

Every layout sees the same global batches (the sampler is a pure function of the step; DP ranks
take row slices) and draws the same dropout masks (`tp_dropout` is TP- and DP-invariant), so the
only differences are the order of floating-point sums: the TP all-reduces, DP gradient averaging,
DeepSpeed's flattened gradient buffers. Measured here over the 20 steps: at most 1.9e-7 relative
in the loss and 6.5e-7 in the gradient norm; we allow 10x that (2e-6, 1e-5), since Adam's
normalised updates can carry rounding forward. A wrong mask, a missed reduction or a
double-counted gradient moves the loss by 1e-3 or more within a few steps.
"""
import numpy as np
import pytest
import torch

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.models import GPT, GPTConfig
from bigdense.testing import run_ranks

pytestmark = pytest.mark.slow  # 20 steps of the GPT at four layouts

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 20, 4, 32, 515  # 515: uneven over TP=2


def _global_batch(step):
    """Tokens drawn from 16 ids spread over the vocabulary (so over both TP shards): a model learns
    their frequencies within a few steps, so the losses move and the comparison means something."""
    g = np.random.default_rng([7, step])
    tokens = torch.from_numpy(g.choice(np.arange(0, VOCAB, 32), size=(GLOBAL_BATCH, SEQ + 1)))
    return tokens[:, :-1], tokens[:, 1:]


def _train(tp, engine_kind, sequence_parallel=False):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=SEQ,
                          dropout=0.1, head_chunk_size=48, sequence_parallel=sequence_parallel),
                tp_group=ctx.tp_group)
    local = GLOBAL_BATCH // ctx.dp_size
    engine = bd.build_engine(
        model, ctx, engine_cfg=EngineConfig(kind=engine_kind, zero_stage=1),
        optim_cfg=OptimConfig(lr=3e-3, warmup_steps=3), precision_cfg=PrecisionConfig(dtype="fp32"),
        micro_batch_size=local, grad_accum=1, max_steps=STEPS,
    )
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        rows = slice(ctx.dp_rank * local, (ctx.dp_rank + 1) * local)
        result = engine.train_step([(x[rows], y[rows])])
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return losses, norms


def test_gpt_losses_agree_step_by_step_across_layouts_and_engines():
    _assert_layouts_agree({
        "tp=2 (DDP engine)": run_ranks(_train, 2, 2, "ddp"),
        "tp=2 x dp=2 (DDP)": run_ranks(_train, 4, 2, "ddp"),
        "tp=2, DeepSpeed ZeRO-1": run_ranks(_train, 2, 2, "deepspeed", timeout=600),
    })


@pytest.mark.slow
def test_gpt_losses_with_sequence_parallelism_agree_with_tp1():
    """Sequence parallelism changes only the order of the TP sums; the masks are the same rows."""
    _assert_layouts_agree({
        "tp=2 SP (DDP engine)": run_ranks(_train, 2, 2, "ddp", True),
        "tp=4 SP (DDP engine)": run_ranks(_train, 4, 4, "ddp", True),
        "tp=2 x dp=2 SP (DDP)": run_ranks(_train, 4, 2, "ddp", True),
        "tp=2 SP, DeepSpeed ZeRO-1": run_ranks(_train, 2, 2, "deepspeed", True, timeout=600),
    })


def _assert_layouts_agree(layouts):
    reference = run_ranks(_train, 1, 1, "ddp")[0]
    ref_losses, ref_norms = map(np.array, reference)
    assert ref_losses[-1] < ref_losses[0] - 0.3, "the reference run should learn something in 20 steps"
    for name, per_rank in layouts.items():
        for rank, (losses, norms) in enumerate(per_rank):
            np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, err_msg=f"{name}, rank {rank}: losses")
            np.testing.assert_allclose(norms, ref_norms, rtol=1e-5, err_msg=f"{name}, rank {rank}: grad norms")
