"""The reference GPT with sequence parallelism: exact collective counts of a block, parity with tp=1
(dropout on), clipping, activation checkpointing, layout-free checkpoints. (20 training steps per
layout and engine: test_train_parity.)

Tolerances as in test_models / test_train_parity: sequence parallelism changes only the order of the
TP sums (reduce-scatters instead of all-reduces, weight gradients over gathered rows); the dropout
masks are the same rows of the same global masks.
"""
import numpy as np
import pytest
import torch

import bigdense as bd
from bigdense.config import RecomputeConfig
from bigdense.models import GPT, GPTConfig
from bigdense.models.gpt import Block
from bigdense.parallel import comm
from bigdense.testing import run_ranks
from helpers import assert_close

VOCAB, SEQ = 203, 15  # 203 rows and 15 positions: uneven over 2 and 4 ranks


def _cfg(**kw):
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.2, head_chunk_size=10)
    return GPTConfig(**{**base, **kw})


# ---- collective counts of one block ----
B, S, D = 2, 8, 16


def _block_counts(sequence_parallel):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    block = Block(_cfg(d_model=D, dropout=0.0, sequence_parallel=sequence_parallel), ctx.tp_group)
    x = torch.randn(B, S, D)
    x = (comm.split_dim(x, -2, ctx.tp_group) if sequence_parallel else x).requires_grad_()
    with bd.set_checks(False):  # the hot loop's setting: no exchange of sequence lengths
        with bd.count_collectives() as forward:
            y = block(x, seq_len=S)
        with bd.count_collectives() as backward:
            y.backward(torch.ones_like(y))
    return forward.by_kind, backward.by_kind


def test_gpt_block_collective_counts_with_and_without_sequence_parallelism():
    activation = B * S * D * 4  # fp32 bytes of one (B, S, d) activation, whole
    forward, backward = run_ranks(_block_counts, 2, False)[0]
    assert forward == {"all_reduce": (2, 2 * activation)}
    assert backward == {"all_reduce": (2, 2 * activation)}

    forward, backward = run_ranks(_block_counts, 2, True)[0]
    assert forward == {"all_gather": (2, 2 * activation), "reduce_scatter": (2, 2 * activation)}
    # The mirror image, plus the re-gathers of the column layers' inputs; all-reduces only of the
    # replicated parameters' gradients (ln1, ln2 weight and bias, attention-out and MLP-down biases).
    assert backward == {
        "all_gather": (4, 4 * activation),
        "reduce_scatter": (2, 2 * activation),
        "all_reduce": (6, 6 * D * 4),
    }


# ---- parity with tp=1 ----
def _grads(model, ctx):
    full = lambda t, dim: comm.all_gather_dim(t, dim, ctx.tp_group).clone()  # noqa: E731
    return {
        "tok_emb": full(model.tok_emb.weight.grad, 0),
        "qkv": full(model.blocks[0].attn.qkv.weight.grad, 0),
        "out.bias": model.blocks[1].attn.out.bias.grad.clone(),
        "ln1": model.blocks[0].ln1.weight.grad.clone(),
        "ln_f": model.ln_f.weight.grad.clone(),
        "pos_emb": model.pos_emb.weight.grad.clone(),
    }


def _gpt_run(tp, sequence_parallel, activation="gelu"):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(_cfg(sequence_parallel=sequence_parallel, activation=activation), tp_group=ctx.tp_group)
    idx = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    grads = _grads(model, ctx)
    norm = bd.clip_grad_norm_(model, 0.5)  # the unsharded norm, replicated gradients counted once
    return loss.item(), grads, norm.item(), _grads(model, ctx)["ln_f"]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_gpt_with_sequence_parallelism_matches_tp1_with_dropout_on(activation):
    ref_loss, ref_grads, ref_norm, ref_clipped = _gpt_run(1, False, activation)
    for tp in (2, 4):
        for rank, (loss, grads, norm, clipped) in enumerate(run_ranks(_gpt_run, tp, tp, True, activation)):
            where = f"tp={tp} with SP, rank {rank}"
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"{where}: loss {loss} vs {ref_loss}"
            for name, g in grads.items():
                # 5e-6 of the tensor's largest entry: small entries are sums with cancellation.
                assert_close(g, ref_grads[name], f"{where}: grad {name}", rtol=0, atol=5e-6 * ref_grads[name].abs().max())
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"{where}: grad norm {norm} vs {ref_norm}"
            assert_close(clipped, ref_clipped, f"{where}: clipped ln_f grad", rtol=0, atol=5e-6 * ref_clipped.abs().max())


# ---- the DDP engine sums the partial gradients once per step ----
ACCUM, ROWS = 2, 2  # micro-batches per step; rows per DP rank


def _engine_vs_eager(tp, recompute):
    """One DDP-engine step (SP, 2 micro-batches) against the layers' own eager sums: the same
    model built twice, the same micro-batches, rows and dropout seeds."""
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.parallel.partial_grads import partial_grad_params

    ctx = bd.init_parallel(tp=tp)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (ROWS * ctx.dp_size, SEQ), generator=g) for _ in range(ACCUM)]
    mine = [idx[ctx.dp_rank * ROWS:(ctx.dp_rank + 1) * ROWS] for idx in batches]

    def build():
        torch.manual_seed(0)
        model = GPT(_cfg(sequence_parallel=True), tp_group=ctx.tp_group)
        bd.apply_recompute(model.blocks, RecomputeConfig(mode=recompute))
        return model

    model = build()
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OptimConfig(grad_clip=0.0),
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=ROWS,
                             grad_accum=ACCUM, max_steps=1)
    torch.manual_seed(5)
    with bd.set_checks(False), bd.count_collectives() as counts:
        engine.train_step([(idx, idx.roll(-1, dims=1)) for idx in mine])
    deferred = {n: p.grad.clone() for n, p in model.named_parameters()}

    twin = build()
    torch.manual_seed(5)
    for idx in mine:
        with bd.batch_slice(ctx.dp_rank * ROWS, ctx.dp_size * ROWS):
            (twin(idx, idx.roll(-1, dims=1)) / ACCUM).backward()
    eager = {}
    for n, p in twin.named_parameters():  # DDP's averaging, done by hand
        eager[n] = comm.all_reduce_(p.grad.clone(), ctx.dp_group) / ctx.dp_size if ctx.dp_size > 1 else p.grad
    partial_bytes = sum(p.numel() * 4 for p, _ in partial_grad_params(model))
    reduces = [b for phase, kind, b in counts.events if phase == "issue" and kind == "all_reduce"]
    return deferred, eager, partial_bytes, reduces, [n for n, p in model.named_parameters()
                                                       if any(p is q for q, _ in partial_grad_params(model))]


@pytest.mark.parametrize("tp,world,recompute", [(2, 2, "none"), (2, 2, "full"),
                                                pytest.param(2, 4, "none", marks=pytest.mark.slow)])
def test_ddp_engine_sums_the_partial_gradients_once_per_step(tp, world, recompute):
    for rank, (deferred, eager, partial_bytes, reduces, partial) in enumerate(
            run_ranks(_engine_vs_eager, world, tp, recompute)):
        where = f"tp={tp} world={world} recompute={recompute}, rank {rank}"
        # Per block: ln1, ln2 (weight and bias), the attention-out and MLP-down biases; and ln_f.
        assert len(partial) == 2 * 6 + 2 and all(n.endswith(("ln1.weight", "ln2.bias", "ln_f.weight", "out.bias",
                                                             "down.bias", "ln1.bias", "ln2.weight", "ln_f.bias"))
                                                  for n in partial), partial
        # One all-reduce of all of them for the step (eagerly: one per parameter per micro-batch,
        # 28 here); the step's other all-reduces are a few scalars (the step's count of targets, the
        # norm, the skip vote, the report of the loss and the fused loss's counts: 16 bytes).
        assert reduces.count(partial_bytes) == 1 and all(b == partial_bytes or b <= 16 for b in reduces), reduces
        for name, g in deferred.items():
            # Summing over TP after accumulating (and after DP averaging) instead of before only
            # reorders the additions: 1e-6 of the tensor's largest entry.
            assert_close(g, eager[name], f"{where}: grad {name}", rtol=0, atol=1e-6 * eager[name].abs().max())


def _recompute_grads():
    ctx = bd.init_parallel(tp=2)
    results = {}
    for mode in ("none", "full", "mlp"):
        torch.manual_seed(0)
        model = GPT(_cfg(sequence_parallel=True), tp_group=ctx.tp_group)
        bd.apply_recompute(model.blocks, RecomputeConfig(mode=mode))
        idx = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
        model(idx, idx.roll(-1, dims=1)).backward()
        results[mode] = [p.grad.clone() for p in model.parameters()]
    return all(torch.equal(a, b) for mode in ("full", "mlp") for a, b in zip(results["none"], results[mode]))


def test_activation_checkpointing_with_sequence_parallelism_gives_bit_identical_gradients():
    # The recompute replays the same ops, gathers and dropout seeds on the same shares: exact.
    assert all(run_ranks(_recompute_grads, 2))


# ---- checkpoints stay layout-free ----
def _steps(model, opt, n, start):
    losses = []
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        loss = model(idx, idx.roll(-1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _model_and_opt(tp, sequence_parallel, seed):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(seed)
    model = GPT(_cfg(sequence_parallel=sequence_parallel), tp_group=ctx.tp_group)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _save_with_sp(path):
    model, opt = _model_and_opt(2, True, 0)
    _steps(model, opt, 3, 0)
    bd.save_checkpoint(path, model, opt, step=3)
    return _steps(model, opt, 3, 3)


def _load_without_sp(tp, path):
    model, opt = _model_and_opt(tp, False, 12345)  # another seed: only the checkpoint can make it agree
    bd.load_checkpoint(path, model, opt)
    return _steps(model, opt, 3, 3)


def test_checkpoint_saved_with_sequence_parallelism_continues_identically_without(tmp_path):
    path = str(tmp_path / "step_3")
    with_sp = run_ranks(_save_with_sp, 2, path)[0]
    for tp in (1, 4):
        for rank, losses in enumerate(run_ranks(_load_without_sp, tp, tp, path)):
            np.testing.assert_allclose(losses, with_sp, rtol=2e-6, err_msg=f"tp={tp} without SP, rank {rank}")
