"""The loss of a step is weighted by tokens, as Hugging Face's Trainer weighs it with num_items_in_batch:
two micro-batches on each of two DP ranks, holding different numbers of ignored targets (-100), train
exactly as one batch holding all of them, under DDP, FSDP and DeepSpeed ZeRO-1.

The reference is one process taking the whole batch in one micro-batch (its weight is 1: the plain
mean over every counted token). AdamW with eps = lr = 1e3 makes the first update ``g / (|g| + 1e3)``
times 1e3, about the gradient itself, so the weights after one step compare the gradients (Adam's
usual eps would make the first update ``sign(g)``, blind to how tokens are weighted). Tolerance: the
micro-batches and ranks sum the same terms in another order, about 1e-7 relative; 1e-6 allowed. A
mean of micro-batch means instead weighs the row with one counted token as much as the one with 32:
the loss alone moves by 10%.
"""
import pytest
import torch

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.models import GPT, GPTConfig
from bigdense.testing import run_ranks

ROWS, SEQ, VOCAB = 4, 32, 97
IGNORED = (0, 20, 5, 31)  # ignored targets of each row: every micro-batch of each layout counts a different number


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    for row, n in enumerate(IGNORED):
        y[row, :n] = -100
    return x, y


def _one_step(engine_kind: str, dp: int, accum: int):
    ctx = bd.init_parallel(tp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=SEQ, head_chunk_size=24),
                tp_group=ctx.tp_group)
    rows = ROWS // (dp * accum)
    engine = bd.build_engine(
        model, ctx, engine_cfg=EngineConfig(kind=engine_kind, zero_stage=1),
        optim_cfg=OptimConfig(lr=1e3, eps=1e3, weight_decay=0.0, grad_clip=0.0, warmup_steps=0),
        precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=rows, grad_accum=accum, max_steps=1,
    )
    x, y = _batch()
    # Micro-batch i of DP rank d: rows [(i * dp + d) * rows, ...) -- the engines' global micro-batch order.
    micro = [((i * dp + ctx.dp_rank) * rows, (i * dp + ctx.dp_rank + 1) * rows) for i in range(accum)]
    result = engine.train_step([(x[a:b], y[a:b]) for a, b in micro])
    return result.loss, result.tokens, _full_weights(engine)


def _full_weights(engine):
    from bigdense.parallel.sharding import local_tensor

    out = {}
    for name, p in engine.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else local_tensor(p)
        out[name] = full.detach().clone()
    return out


@pytest.fixture(scope="module")
def one_batch():
    return run_ranks(_one_step, 1, "ddp", 1, 1)[0]


@pytest.mark.parametrize("engine_kind", ["ddp", "fsdp", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_two_micro_batches_on_two_ranks_train_as_one_batch(one_batch, engine_kind):
    want_loss, want_tokens, want = one_batch
    assert want_tokens == ROWS * SEQ - sum(IGNORED)
    for rank, (loss, tokens, got) in enumerate(run_ranks(_one_step, 2, engine_kind, 2, 2, timeout=300)):
        assert tokens == want_tokens, (engine_kind, rank)
        assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (engine_kind, rank, loss, want_loss)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-7, msg=f"{engine_kind} rank {rank}: {name}")


def test_a_mean_of_micro_batch_means_would_differ(one_batch):
    # The counted tokens per micro-batch differ enough that the plain mean of means is far off.
    want_loss = one_batch[0]
    model_losses = run_ranks(_per_row_losses, 1)[0]
    mean_of_means = sum(model_losses) / len(model_losses)
    assert abs(mean_of_means - want_loss) > 1e-3 * want_loss


def _per_row_losses():
    ctx = bd.init_parallel(tp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=SEQ, head_chunk_size=24),
                tp_group=ctx.tp_group)
    x, y = _batch()
    with torch.no_grad():
        return [float(model(x[r:r + 1], y[r:r + 1])) for r in range(ROWS)]
