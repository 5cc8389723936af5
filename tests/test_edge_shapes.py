"""No shape hangs a job: the layers, their inference stand-ins and the reference models at the edges
of their shapes; and the collective-schedule check itself.

Every case runs on gloo ranks under the collective-schedule check (`bd.check_schedule`: the ranks
agree on each collective before it is issued, so a divergence fails at once, naming the layer,
instead of hanging), through forward and backward -- with activation checkpointing, and through
an engine step where DP matters -- and is compared with an independent unsharded reference
written with plain torch ops on the gathered full tensors (`helpers.py`).

The edges: sequence lengths 0, 1, tp-1, tp, tp+1 and uneven (a rank whose sequence share is
empty); class counts below, at and above tp (a rank with no class); sample rates whose sample
leaves a shard empty (only the targets are sampled, and they fall on one shard); DP ranks with 0, 1
and many tokens; layer widths below tp (a rank holding no feature, for the float layers and for
the int8 and sparse stand-ins); every reduction and gradient strategy, ArcFace and CosFace margins,
label smoothing, ignored tokens none, some or all; dropout on and off; sequence parallelism on and off.
The quick subset runs tp=2, tp=1 x dp=2 and the three reproductions this sweep was written for;
the slow one adds tp=3 and tp=2 x dp=2.

Tolerances (fp32): the sharded computations sum the same products in another order (per-rank
partial sums, chunked weight gradients, the balanced splits), a few ulps of values of order 1:
1e-5 relative and absolute for linear layers and the plain head. Margin heads run at scale 8,
where the cosines' ulps are multiplied by the scale: 1e-4. GPT gradients are compared to 2e-5 of
the largest entry of their tensor (absolute: small entries are sums with cancellation). A wrong
mask, a missing contribution or a shard in the wrong place moves results by 1e-2 or more. The
stand-ins' `to_dense` is compared bit for bit (it gathers ``q s`` or the kept weights, computed
elementwise as the reference computes them); their outputs and input gradients at 1e-5 (fp32 sums
of at most 6 products in another order).
"""
import itertools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig, RecomputeConfig
from bigdense.layers.head.sampling import sampled_class_mask
from bigdense.models import GPT, GPTConfig, TextClassifier
from bigdense.parallel import comm
from bigdense.parallel.random import draw_seed
from bigdense.testing import RankError, run_ranks

from helpers import (
    assert_close, full_params, head_reference, insightface_logits, plain_gpt_hidden, plain_gpt_loss, shard_specs,
)

FP32 = dict(rtol=1e-5, atol=1e-5)
MARGIN_TOL = dict(rtol=1e-4, atol=1e-4)
SCALE = 8.0  # margin heads' scale
D = 6  # features of every layer here
MARGINS = {None: None, "arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.35)}
CHECK_TIMEOUT_S = 20.0


def seq_lengths(tp):
    """0, 1, tp-1, tp, tp+1 and an uneven length above them."""
    return sorted({0, 1, tp - 1, tp, tp + 1, 2 * tp + 1})


def _share(total, ctx, sp):
    return bd.shard_range(total, ctx.tp_size, ctx.tp_rank) if sp else (0, total)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_grads(module, full, what, tp_group, tol, *, scale_of=None):
    """Every parameter gradient of ``module`` equals its slice of the reference's full one."""
    specs = shard_specs(module)
    for name, p in module.named_parameters():
        ref = full[name].grad if full[name].grad is not None else torch.zeros_like(full[name])
        expected = specs[name].slice_of(ref) if name in specs else ref
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        if scale_of is not None:  # absolute, at a fraction of the tensor's largest entry
            atol = scale_of * max(ref.abs().max().item(), 1e-6) if ref.numel() else 0.0
            assert_close(got, expected, f"{what}: grad of {name}", rtol=0, atol=atol)
        else:
            assert_close(got, expected, f"{what}: grad of {name}", **tol)


# ---- layers: ParallelMLP (column -> row), Column with gathered output -> Row splitting its input,
# the vocab-parallel embedding ----
def _mlp_case(ctx, s, sp, p, recompute, activation):
    hidden = 2 * ctx.tp_size + 1  # uneven
    torch.manual_seed(s)
    mlp = bd.ParallelMLP(D, hidden, activation, dropout=p, sequence_parallel=sp)
    if recompute:
        bd.checkpoint_module(mlp)
    full = full_params(mlp, ctx.tp_group)
    x, w = _randn(2, s, D, seed=s), _randn(2, s, D, seed=s + 1)
    lo, hi = _share(s, ctx, sp)
    xs = x[:, lo:hi].clone().requires_grad_()
    torch.manual_seed(100)
    y = mlp(xs, s) if sp else mlp(xs)
    (y * w[:, lo:hi]).sum().backward()

    xr = x.clone().requires_grad_()
    up = F.linear(xr, full["up.weight"], full["up.bias"])
    act = F.silu(F.linear(xr, full["gate.weight"], full["gate.bias"])) * up if activation == "swiglu" else F.gelu(up)
    torch.manual_seed(100)
    yr = bd.tp_dropout(F.linear(act, full["down.weight"], full["down.bias"]), p)
    (yr * w).sum().backward()
    what = f"ParallelMLP({activation}) S={s} sp={sp} dropout={p} recompute={recompute}"
    assert_close(y, yr[:, lo:hi], f"{what}: output", **FP32)
    assert_close(xs.grad, xr.grad[:, lo:hi], f"{what}: input grad", **FP32)
    _check_grads(mlp, full, what, ctx.tp_group, FP32)


def _column_row_case(ctx, n, width):
    """Column(gather_output=True) -> Row(input_is_parallel=False): width < tp leaves ranks empty."""
    torch.manual_seed(width)
    col = bd.ColumnParallelLinear(D, width, gather_output=True)
    row = bd.RowParallelLinear(width, D, input_is_parallel=False)
    model = torch.nn.Sequential(col, row)
    full = full_params(model, ctx.tp_group)
    x = _randn(n, D, seed=n).requires_grad_()
    (model(x) ** 2).sum().backward()
    xr = x.detach().clone().requires_grad_()
    yr = F.linear(F.linear(xr, full["0.weight"], full["0.bias"]), full["1.weight"], full["1.bias"])
    (yr ** 2).sum().backward()
    what = f"Column({D}->{width}, gather) -> Row, {n} rows"
    assert_close(x.grad, xr.grad, f"{what}: input grad", **FP32)
    _check_grads(model, full, what, ctx.tp_group, FP32)


def _embedding_case(ctx, s, sp, vocab):
    torch.manual_seed(vocab)
    emb = bd.VocabParallelEmbedding(vocab, D, sequence_parallel=sp)
    full = full_params(emb, ctx.tp_group)
    ids = torch.randint(0, vocab, (2, s), generator=torch.Generator().manual_seed(s))
    w = _randn(2, s, D, seed=s)
    lo, hi = _share(s, ctx, sp)
    (emb(ids) * w[:, lo:hi]).sum().backward()
    (F.embedding(ids, full["weight"]) * w).sum().backward()
    _check_grads(emb, full, f"VocabParallelEmbedding({vocab}) S={s} sp={sp}", ctx.tp_group, FP32)


def _layer_sweep():
    ctx = bd.init_parallel(tp=torch.distributed.get_world_size())
    tp = ctx.tp_size
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        for i, (s, sp, p, recompute) in enumerate(itertools.product(seq_lengths(tp), (False, True), (0.0, 0.3),
                                                                    (False, True))):
            _mlp_case(ctx, s, sp, p, recompute, ("gelu", "swiglu")[i % 2])
        for n, width in itertools.product((0, 1, 5), sorted({1, tp - 1, tp + 1} - {0})):
            _column_row_case(ctx, n, width)
        for s, sp, vocab in itertools.product(seq_lengths(tp), (False, True), sorted({1, tp - 1, tp, tp + 1} - {0})):
            _embedding_case(ctx, s, sp, vocab)
    return "ok"


# ---- the inference stand-ins (int8 weights, sparse products) of column and row layers ----
STAND_INS = ("int8", "csr", "to_sparse")


def _int8_reference(w):
    """int8's definition on the full weight: per row, s = max|W| / 127, q = round(W / s): W is q s."""
    s = w.abs().amax(dim=1) / 127
    return torch.round(w / torch.where(s > 0, s, torch.ones_like(s))[:, None]).clamp(-127, 127) * s[:, None]


def _stand_in(name, layer):
    """``layer``'s stand-in ``name``: int8 weights, or a sparse product of its pruned weights (built
    directly, or chosen by `bd.to_sparse`)."""
    if name == "int8":
        return bd.quantize_int8(layer)
    if name == "csr":
        return bd.SparseLinear(layer)
    report = bd.to_sparse(layer, min_speedup=1e-9, sample_tokens=2, repeats=1)
    assert [row["format"] for row in report.layers] == ["csr"], report.layers
    return report.module


def _stand_in_case(ctx, name, layout, width, s):
    """One stand-in against ``x W^T + b`` on the full weight it computes with. ``layout``: column
    (gathered or sharded output) from D to ``width`` features, row from ``width`` to D (input split here
    or already split), or either under sequence parallelism; ``width`` < tp leaves a rank no feature.
    ``s``: rows (sequence length under sequence parallelism; a batch of 2 then)."""
    kind, option = layout
    torch.manual_seed(width)
    sp = option == "sp"
    if kind == "column":
        layer = bd.ColumnParallelLinear(D, width, gather_output=option == "gather", sequence_parallel=sp)
    else:
        layer = bd.RowParallelLinear(width, D, input_is_parallel=option != "split here", sequence_parallel=sp)
    if name != "int8":
        bd.prune(layer, 0.5)
    full = full_params(layer, ctx.tp_group)
    weight, bias = full["weight"].detach(), full["bias"].detach()
    if name == "int8":
        weight = _int8_reference(weight)
    stand_in = _stand_in(name, layer)
    dense = stand_in.to_dense()
    what = f"{name} of {kind}({option}) width={width} rows={s} tp={ctx.tp_size}"
    assert torch.equal(dense.weight, weight) and torch.equal(dense.bias, bias), what

    shape = (2, s) if sp else (s,)
    x, g = _randn(*shape, weight.shape[1], seed=s), _randn(*shape, weight.shape[0], seed=s + 1)
    feat = bd.shard_range(width, ctx.tp_size, ctx.tp_rank)
    seq = _share(s, ctx, sp)
    take_in = slice(*feat) if kind == "row" and option != "split here" else slice(None)
    take_out = slice(*feat) if kind == "column" and option != "gather" else slice(None)
    x_in, out_seq = (x[:, slice(*seq)], slice(None)) if kind == "column" and sp else (x, slice(*seq) if sp else None)
    xs = x_in[..., take_in].clone().requires_grad_()
    y = stand_in(xs, s) if kind == "column" and sp else stand_in(xs)
    g_mine = g[..., take_out] if out_seq is None else g[:, out_seq][..., take_out]
    (y * g_mine).sum().backward()
    y_ref, grad_ref = x @ weight.T + bias, g @ weight
    y_ref = y_ref[..., take_out] if out_seq is None else y_ref[:, out_seq][..., take_out]
    grad_ref = grad_ref[:, slice(*seq)] if kind == "column" and sp else grad_ref
    assert_close(y, y_ref, f"{what}: output", **FP32)
    assert_close(xs.grad, grad_ref[..., take_in], f"{what}: input grad", **FP32)


def _semi_structured_is_refused_alike(ctx, width):
    """2:4 needs a CUDA GPU: every rank refuses, an empty shard's rank too (the ranks agree first)."""
    layer = bd.RowParallelLinear(width, D, input_is_parallel=False)
    bd.prune(layer, 0.5)
    every = f"refused on TP rank(s) {list(range(ctx.tp_size))} (this rank: 2:4 sparse kernels need a CUDA"
    with pytest.raises(ValueError, match=re.escape(every)):
        bd.SparseLinear(layer, "semi_structured")


def _stand_in_sweep():
    ctx = bd.init_parallel(tp=torch.distributed.get_world_size())
    tp = ctx.tp_size
    widths = sorted({1, tp - 1, tp + 1} - {0})
    layouts = [("column", "gather"), ("column", "sharded"), ("row", "split here"), ("row", "split")]
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        # Each stand-in meets every layout at every width (an empty shard among them), the row counts
        # turning among the stand-ins from one (layout, width) to the next.
        for i, (layout, width, rows) in enumerate(itertools.product(layouts, widths, (0, 1, 5))):
            _stand_in_case(ctx, STAND_INS[(i + i // 3) % 3], layout, width, rows)
        for i, (layout, width, s) in enumerate(itertools.product((("column", "sp"), ("row", "sp")), widths,
                                                                 seq_lengths(tp))):
            _stand_in_case(ctx, STAND_INS[i % 3], layout, width, s)
        if not torch.cuda.is_available():
            _semi_structured_is_refused_alike(ctx, 1)
    return "ok"


# ---- the classifier head, classes split over TP ----
def _head_case(ctx, c, margin, rate, n_tokens, reduction, eps, ignore, strategy, sp=False, s=None):
    torch.manual_seed(c)
    bias = margin is None and c % 2 == 1
    head = bd.ParallelClassifierHead(D, c, bias=bias, margin=margin, scale=SCALE, sample_rate=rate, chunk_size=3,
                                     grad_strategy=strategy, sequence_parallel=sp)
    full = full_params(head, ctx.tp_group)
    shape = (2, s) if sp else (n_tokens,)
    h = _randn(*shape, D, seed=c + (2 * s if sp else n_tokens))
    target = torch.randint(0, c, shape, generator=torch.Generator().manual_seed(c + 7))
    if ignore == "some":
        target.view(-1)[::3] = -100
    elif ignore == "all":
        target.fill_(-100)
    weights = _randn(*shape, seed=3)
    lo, hi = _share(s, ctx, sp) if sp else (0, None)
    hs = (h[:, lo:hi] if sp else h).clone().requires_grad_()
    torch.manual_seed(1000)
    loss = head.loss(hs, target, label_smoothing=eps, reduction=reduction)
    (loss * weights if reduction == "none" else loss).sum().backward()

    torch.manual_seed(1000)  # the reference draws the seed the head draws
    classes = None if rate == 1.0 else sampled_class_mask(draw_seed(), target, 0, c, rate).nonzero().squeeze(1)
    ref_loss, ref_h, ref_w, ref_b = head_reference(
        full["weight"].detach(), h.reshape(-1, D), target.reshape(-1), margin=MARGINS[margin], classes=classes,
        eps=eps, bias=full["bias"].detach() if bias else None, reduction=reduction, weights=weights.reshape(-1),
        scale=SCALE)
    what = (f"head C={c} margin={margin} rate={rate} tokens={tuple(shape)} sp={sp} reduction={reduction} "
            f"eps={eps} ignore={ignore} {strategy}")
    tol = FP32 if margin is None else MARGIN_TOL
    assert_close(loss.reshape(-1), ref_loss.reshape(-1), f"{what}: loss", **tol)
    ref_h = ref_h.reshape(*shape, D)
    assert_close(hs.grad, ref_h[:, lo:hi] if sp else ref_h, f"{what}: grad h", **tol)
    spec = head.shard_spec("weight")
    assert_close(head.weight.grad, spec.slice_of(ref_w), f"{what}: grad W", **tol)
    if bias:
        assert_close(head.bias.grad, head.shard_spec("bias").slice_of(ref_b), f"{what}: grad b", **tol)
    k = min(2, c)
    _, ids = head.predict(h[:, lo:hi] if sp else h, k=k)
    w = full["weight"].detach()
    z = F.normalize(h, dim=-1) @ F.normalize(w, dim=-1).T if margin else F.linear(h, w, full.get("bias"))
    assert torch.equal(ids, z.topk(k, dim=-1).indices), f"{what}: predict"


def _head_sweep():
    ctx = bd.init_parallel(tp=torch.distributed.get_world_size())
    tp = ctx.tp_size
    reductions, ignores, strategies = ("mean", "sum", "none"), ("none", "some", "all"), ("forward", "recompute")
    counts = sorted({1, tp - 1, tp, tp + 1, 2 * tp + 1} - {0})
    # The class count, margin, sample rate and token count decide the collectives; the rest is cycled.
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        grid = itertools.product(counts, MARGINS, (1.0, 1e-9, 0.5), (0, 1, 7))
        for i, (c, margin, rate, n) in enumerate(grid):
            _head_case(ctx, c, margin, rate, n, reductions[i % 3], (0.0, 0.1)[i // 3 % 2], ignores[i // 2 % 3],
                       strategies[i // 5 % 2])
        for i, (s, c, margin) in enumerate(itertools.product(seq_lengths(tp), (1, tp + 1), (None, "cosface"))):
            _head_case(ctx, c, margin, (1.0, 1e-9)[i % 2], None, reductions[i % 3], 0.1 * (i % 2),
                       ignores[i // 2 % 3], strategies[i // 3 % 2], sp=True, s=s)
    return "ok"


# ---- the world-sharded head: classes split over every rank, tokens gathered over DP ----
def _world_case(ctx, tokens, margin, rate, reduction, eps, strategy):
    c = 2 * ctx.world_size + 1
    torch.manual_seed(c)
    head = bd.ParallelClassifierHead(D, c, bias=False, shard="world", margin=margin, scale=SCALE, sample_rate=rate,
                                     chunk_size=3, grad_strategy=strategy)
    spec = head.shard_spec("weight")
    w = torch.empty(c, D)  # the full weight, gathered over the whole mesh with a plain collective
    w.copy_(comm.all_gather_dim(head.weight.detach(), 0, torch.distributed.group.WORLD, spec.sizes))
    hs = [_randn(n, D, seed=10 * d + n) for d, n in enumerate(tokens)]
    ts = [torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(d)) for d, n in enumerate(tokens)]
    ts = [torch.where(torch.arange(n) % 4 == 3, -100, t) for n, t in zip(tokens, ts)]
    ws = [_randn(n, seed=d + 50) for d, n in enumerate(tokens)]
    me = ctx.dp_rank
    h = hs[me].clone().requires_grad_()
    torch.manual_seed(1000)
    loss = head.loss(h, ts[me], label_smoothing=eps, reduction=reduction)
    (loss * ws[me] if reduction == "none" else loss).sum().backward()

    torch.manual_seed(1000)
    every = torch.cat(ts)
    classes = None if rate == 1.0 else sampled_class_mask(draw_seed(), every, 0, c, rate).nonzero().squeeze(1)
    refs = [head_reference(w, hd, td, margin=MARGINS[margin], classes=classes, eps=eps, reduction=reduction,
                           weights=wd, scale=SCALE) for hd, td, wd in zip(hs, ts, ws)]
    what = f"world head {ctx.tp_size}x{ctx.dp_size} tokens={tokens} margin={margin} rate={rate} {reduction} {strategy}"
    tol = FP32 if margin is None else MARGIN_TOL
    assert_close(loss.reshape(-1), refs[me][0].reshape(-1), f"{what}: loss", **tol)
    assert_close(h.grad, refs[me][1], f"{what}: grad h", **tol)
    # The weight's gradient is the DP average of every rank's loss gradient (what DDP makes of a TP head).
    ref_w = torch.stack([r[2] for r in refs]).mean(0)
    assert_close(head.weight.grad, spec.slice_of(ref_w), f"{what}: grad W", **tol)


def _world_sweep(tp, patterns):
    ctx = bd.init_parallel(tp=tp)
    reductions, strategies = ("mean", "sum", "none"), ("forward", "recompute")
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        for i, (tokens, margin, rate) in enumerate(itertools.product(patterns, (None, "arcface"), (1.0, 1e-9))):
            _world_case(ctx, tokens, margin, rate, reductions[i % 3], 0.1 * (i // 3 % 2), strategies[i // 2 % 2])
    return "ok"


# ---- the reference GPT: every sequence length, SP, dropout, recompute ----
def _gpt_cfg(tp, **kw):
    heads = tp
    return GPTConfig(vocab_size=2 * tp + 1, d_model=4 * heads, n_layers=2, n_heads=heads, max_seq_len=2 * tp + 1,
                     head_chunk_size=3, **kw)


def _gpt_case(ctx, s, sp, p, recompute):
    torch.manual_seed(s)
    cfg = _gpt_cfg(ctx.tp_size, dropout=p, sequence_parallel=sp, activation=("gelu", "swiglu")[s % 2])
    model = GPT(cfg, tp_group=ctx.tp_group)
    bd.apply_recompute(model.blocks, RecomputeConfig(mode=recompute))
    full = full_params(model, ctx.tp_group)
    idx = torch.randint(0, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(s))
    targets = idx.roll(-1, dims=1)
    if recompute == "mlp":  # the last position ignored (at S=1: every token)
        targets[:, -1:] = -100
    torch.manual_seed(100)
    loss = model(idx, targets)
    loss.backward()
    torch.manual_seed(100)
    ref = plain_gpt_loss(full, cfg, idx, targets, dropout=p, eps=model.ln_f.eps)
    ref.backward()
    what = f"GPT tp={ctx.tp_size} S={s} sp={sp} dropout={p} recompute={recompute}"
    assert_close(loss, ref, f"{what}: loss", **FP32)
    _check_grads(model, full, what, ctx.tp_group, None, scale_of=2e-5)


def _gpt_sweep():
    ctx = bd.init_parallel(tp=torch.distributed.get_world_size())
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        for s, sp, p, recompute in itertools.product(seq_lengths(ctx.tp_size), (False, True), (0.0, 0.3),
                                                     ("none", "full", "mlp")):
            _gpt_case(ctx, s, sp, p, recompute)
    return "ok"


# ---- one DDP-engine step: SP's deferred partial sums, the DP average, dropout rows over DP ----
ROWS, ACCUM = 2, 2


def _engine_case(ctx, s, sp, recompute):
    g = torch.Generator().manual_seed(s)
    cfg = _gpt_cfg(ctx.tp_size, dropout=0.3, sequence_parallel=sp)
    batches = [torch.randint(0, cfg.vocab_size, (ROWS * ctx.dp_size, s), generator=g) for _ in range(ACCUM)]
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=ctx.tp_group)
    bd.apply_recompute(model.blocks, RecomputeConfig(mode=recompute))
    full = full_params(model, ctx.tp_group)
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OptimConfig(grad_clip=0.0),
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=ROWS,
                             grad_accum=ACCUM, max_steps=1)
    mine = slice(ctx.dp_rank * ROWS, (ctx.dp_rank + 1) * ROWS)
    torch.manual_seed(5)
    result = engine.train_step([(idx[mine], idx[mine].roll(-1, dims=1)) for idx in batches])
    torch.manual_seed(5)  # the global batch in one process: the masks of its rows are the ranks' masks
    losses = [plain_gpt_loss(full, cfg, idx, idx.roll(-1, dims=1), dropout=0.3, eps=model.ln_f.eps) for idx in batches]
    (sum(losses) / ACCUM).backward()
    what = f"DDP engine tp={ctx.tp_size} dp={ctx.dp_size} S={s} sp={sp} recompute={recompute}"
    assert abs(result.loss - (sum(losses) / ACCUM).item()) <= 1e-5 * max(1.0, abs(result.loss)), what
    _check_grads(model, full, what, ctx.tp_group, None, scale_of=2e-5)


def _engine_sweep(tp, lengths):
    ctx = bd.init_parallel(tp=tp)
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S), bd.set_checks(False):
        for s, sp, recompute in itertools.product(lengths, (False, True), ("none", "full")):
            _engine_case(ctx, s, sp, recompute)
    return "ok"


# ---- the classifier model with a world-sharded head through the DDP engine: DP ranks counting 0, 1
# and many tokens (the others ignored), as a small last batch padded with ignore_index ----
CLS_ROWS = 3
def _classifier_engine_case(ctx, counted, margin, rate):
    cfg, c = _gpt_cfg(ctx.tp_size, dropout=0.3), 2 * ctx.world_size + 1
    g = torch.Generator().manual_seed(sum(counted))
    idx = torch.randint(0, cfg.vocab_size, (CLS_ROWS * ctx.dp_size, 3), generator=g)
    target = torch.randint(0, c, (CLS_ROWS * ctx.dp_size,), generator=g)
    for d, n in enumerate(counted):
        target[d * CLS_ROWS + n:(d + 1) * CLS_ROWS] = -100
    torch.manual_seed(0)
    model = TextClassifier(cfg, c, tp_group=ctx.tp_group, shard="world", margin=margin, scale=SCALE, sample_rate=rate)
    full = full_params(model, ctx.tp_group)
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OptimConfig(grad_clip=0.0),
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=CLS_ROWS, max_steps=1)
    mine = slice(ctx.dp_rank * CLS_ROWS, (ctx.dp_rank + 1) * CLS_ROWS)
    torch.manual_seed(5)
    result = engine.train_step([(idx[mine], target[mine])])

    torch.manual_seed(5)  # the trunk's masks on the global batch, then the head's sampling seed
    features = plain_gpt_hidden(full, cfg, idx, dropout=0.3, eps=model.ln_f.eps).mean(dim=1)
    w = full["head.weight"]
    if margin is None:
        z = F.linear(features, w, full["head.bias"])
    else:
        z = insightface_logits(features, w, target, SCALE, *MARGINS[margin])
    t = target
    if rate < 1.0:  # the softmax over the sampled classes, targets renumbered
        classes = sampled_class_mask(draw_seed(), target, 0, c, rate).nonzero().squeeze(1)
        remap = torch.full((c,), -100, dtype=torch.long)
        remap[classes] = torch.arange(len(classes))
        z, t = z[:, classes], torch.where(target >= 0, remap[target.clamp(min=0)], -100)
    per_token = F.cross_entropy(z, t, reduction="none")  # 0 where ignored
    # The engine's loss, weighted by tokens: the mean over every DP rank's counted tokens (0 when none).
    ref = per_token.sum() / (target != -100).sum().clamp(min=1)
    ref.backward()
    what = f"TextClassifier world head {ctx.tp_size}x{ctx.dp_size} counted={counted} margin={margin} rate={rate}"
    assert abs(result.loss - ref.item()) <= 1e-5 * max(1.0, abs(ref.item())), (what, result.loss, ref.item())
    _check_grads(model, full, what, ctx.tp_group, None, scale_of=2e-5 if margin is None else 1e-4)


def _classifier_engine_sweep(tp, patterns):
    ctx = bd.init_parallel(tp=tp)
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S), bd.set_checks(False):
        for i, counted in enumerate(patterns):
            for margin, rate in ((None, 1.0), ("cosface", 1e-9), ("arcface", 0.5)):
                _classifier_engine_case(ctx, counted, margin, rate)
    return "ok"


# ---- the quick subset ----
def test_layers_at_every_edge_shape_tp2():
    assert run_ranks(_layer_sweep, 2, timeout=300) == ["ok"] * 2


def test_inference_stand_ins_at_every_edge_shape_tp2():
    assert run_ranks(_stand_in_sweep, 2, timeout=300) == ["ok"] * 2


def test_head_at_every_edge_shape_tp2():
    assert run_ranks(_head_sweep, 2, timeout=300) == ["ok"] * 2


def test_world_head_with_dp_ranks_holding_0_1_and_many_tokens():
    patterns = [(0, 5), (1, 5), (1, 1), (0, 0), (5, 3)]
    assert run_ranks(_world_sweep, 2, 1, patterns, timeout=300) == ["ok"] * 2


def test_gpt_at_every_sequence_length_tp2():
    assert run_ranks(_gpt_sweep, 2, timeout=400) == ["ok"] * 2


def test_ddp_engine_step_at_short_sequences_tp2():
    assert run_ranks(_engine_sweep, 2, 2, [1, 3], timeout=300) == ["ok"] * 2


def test_classifier_engine_step_with_dp_ranks_counting_0_1_and_many_tokens():
    assert run_ranks(_classifier_engine_sweep, 2, 1, [(0, 3), (1, 3), (0, 0)], timeout=300) == ["ok"] * 2


# ---- the slow sweep: tp=3, tp x dp ----
@pytest.mark.slow
@pytest.mark.parametrize("sweep", [_layer_sweep, _stand_in_sweep, _head_sweep, _gpt_sweep],
                         ids=["layers", "stand-ins", "head", "gpt"])
def test_edge_shapes_tp3(sweep):
    assert run_ranks(sweep, 3, timeout=600) == ["ok"] * 3


@pytest.mark.slow
def test_world_head_edge_tokens_tp1_dp3_and_tp2_dp2():
    assert run_ranks(_world_sweep, 3, 1, [(0, 1, 5), (1, 1, 1), (5, 0, 0)], timeout=300) == ["ok"] * 3
    assert run_ranks(_world_sweep, 4, 2, [(0, 4), (1, 0), (3, 3)], timeout=400) == ["ok"] * 4


@pytest.mark.slow
def test_ddp_engine_step_at_short_sequences_tp2_dp2():
    assert run_ranks(_engine_sweep, 4, 2, [1, 3], timeout=600) == ["ok"] * 4


@pytest.mark.slow
def test_classifier_engine_step_tp1_dp3_and_tp2_dp2():
    assert run_ranks(_classifier_engine_sweep, 3, 1, [(0, 1, 3), (3, 0, 1)], timeout=300) == ["ok"] * 3
    assert run_ranks(_classifier_engine_sweep, 4, 2, [(0, 1), (3, 3)], timeout=400) == ["ok"] * 4


# ---- the three reproductions, and the check itself ----
def _sp_recompute_short_sequence(recompute):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    cfg = _gpt_cfg(2, dropout=0.3, sequence_parallel=True)
    model = GPT(cfg, tp_group=ctx.tp_group)
    bd.apply_recompute(model.blocks, RecomputeConfig(mode=recompute))
    full = full_params(model, ctx.tp_group)
    idx = torch.tensor([[3], [1]])  # S=1 < tp: rank 1's share of the sequence is empty
    torch.manual_seed(1)
    loss = model(idx, idx)
    loss.backward()  # (plain backward, no schedule check: the hang showed without it)
    torch.manual_seed(1)
    plain_gpt_loss(full, cfg, idx, idx, dropout=0.3, eps=model.ln_f.eps).backward()
    _check_grads(model, full, f"S=1 recompute={recompute}", ctx.tp_group, None, scale_of=2e-5)
    return loss.item()


@pytest.mark.parametrize("recompute", ["full", "mlp"])
def test_sp_dropout_recompute_with_an_empty_sequence_share_does_not_hang(recompute):
    # Before: the empty share skipped the dropout multiply, saved one tensor fewer, and so recomputed
    # at another point of the backward than its peer: the re-run collectives interleaved differently.
    losses = run_ranks(_sp_recompute_short_sequence, 2, recompute, timeout=60, collective_timeout=20)
    assert losses[0] == losses[1]


def _margin_head_without_classes(c, rate):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(4, c, bias=False, margin="arcface", sample_rate=rate)
    h = _randn(5, 4, seed=1).requires_grad_()
    target = torch.zeros(5, dtype=torch.long)  # every target on rank 0's shard
    for _ in range(3):  # a training loop drifted into different steps' collectives
        head.loss(h, target).backward()
    return h.grad.sum().item()


def test_margin_head_with_a_rank_that_scores_no_class_does_not_hang():
    # num_classes < tp, and a sample that leaves rank 1 nothing (only the targets are kept, all on rank 0).
    # Before: that rank skipped the TP copy whose backward all-reduces h's gradient.
    for c, rate in ((1, 1.0), (9, 1e-9)):
        grads = run_ranks(_margin_head_without_classes, 2, c, rate, timeout=60, collective_timeout=20)
        assert grads[0] == grads[1]


def _world_none_one_token():
    ctx = bd.init_parallel(tp=1)
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        _world_case(ctx, (1, 3), None, 1.0, "none", 0.0, "recompute")
    return "ok"


def test_world_head_reduction_none_with_a_rank_holding_one_token():
    # Before: that rank took its per-token gradient for a scalar and gathered another size (gloo aborts).
    assert run_ranks(_world_none_one_token, 2, timeout=60, collective_timeout=20) == ["ok", "ok"]


def _one_rank_skips(where):
    import time

    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(bd.ColumnParallelLinear(D, 8), torch.nn.GELU(), bd.RowParallelLinear(8, D))
    x = _randn(3, D, seed=0).requires_grad_()
    start = time.monotonic()
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        if where == "forward" and ctx.tp_rank == 1:  # this rank skips the row layer's all-reduce
            model[2].tp_group = None
        try:
            model(x).sum().backward()
        except bd.ScheduleMismatch as err:
            return time.monotonic() - start, str(err)
    return time.monotonic() - start, "finished"


def test_a_skipped_collective_fails_fast_on_every_rank_naming_the_layer():
    for elapsed, message in run_ranks(_one_rank_skips, 2, "forward", timeout=60, collective_timeout=50):
        # Found before the gloo deadline (50 s) and the check's (20 s): the two ranks posted
        # different entries for the same collective.
        assert elapsed < 5.0, elapsed
        assert "disagree at collective #0" in message and "2 (RowParallelLinear)" in message, message
        assert "rank 0: all_reduce" in message and "rank 1: " in message, message


def _probe_on_one_rank():
    ctx = bd.init_parallel(tp=2)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():  # the same full layer on both ranks
        lin.weight.copy_(_randn(3, 4, seed=1))
        lin.bias.copy_(_randn(3, seed=2))
    row = bd.RowParallelLinear.from_dense(lin, input_is_parallel=False)
    x = _randn(2, 4, seed=3).requires_grad_()
    with bd.check_schedule(timeout=CHECK_TIMEOUT_S):
        y1 = row(x)
        if ctx.tp_rank == 0:  # a probe, a metric: a module that issues no collective, on one rank only
            with torch.no_grad():
                torch.nn.Linear(3, 1)(y1)
        y2 = row(x)
        if ctx.tp_rank == 1:  # and one between a forward and its backward
            torch.nn.Linear(3, 1)(y2)
        y2.sum().backward()
    return y1.detach(), y2.detach(), x.grad


def test_a_module_without_collectives_on_one_rank_is_no_mismatch():
    # Before: the end of the probe's forward was compared as if it were a collective: ScheduleMismatch at
    # collective #2, "rank 0: no collective: it reached the end of the forward of Linear; rank 1:
    # all_reduce ... in the forward of RowParallelLinear", though both ranks issued the same collectives.
    w, b, x = _randn(3, 4, seed=1), _randn(3, seed=2), _randn(2, 4, seed=3)
    for y1, y2, grad in run_ranks(_probe_on_one_rank, 2, timeout=60, collective_timeout=50):
        # fp32 partial sums of 2 products each, added in another order: a few ulps.
        assert_close(y1, x @ w.T + b, "y1", **FP32)
        assert_close(y2, x @ w.T + b, "y2", **FP32)
        assert_close(grad, torch.ones(2, 3) @ w, "input grad", **FP32)


def _skips_the_last_collective(where, late=None):
    """tp=2; rank 1 skips the last collective of a pass (the row layer's forward all-reduce; the column
    layer's backward all-reduce, its input needing no gradient there), or stops before the next pass.
    Rank ``late`` starts 0.3 s after the other (which of them sees the other first)."""
    import time

    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(bd.ColumnParallelLinear(D, 8), torch.nn.GELU(), bd.RowParallelLinear(8, D))
    x = _randn(3, D, seed=0)
    if ctx.tp_rank == late:
        time.sleep(0.3)
    start = time.monotonic()
    with bd.check_schedule(timeout=2.0 if where == "stop" else CHECK_TIMEOUT_S):
        try:
            if where == "forward":  # inference: the all-reduce is the pass's last (and only) collective
                group = model[2].tp_group
                with torch.no_grad():
                    if ctx.tp_rank == 1:
                        model[2].tp_group = None
                    model(x)
                    model[2].tp_group = group
                    model(x)  # the same collective again: it must not pair with the skipped one
            elif where == "backward":
                model[0](x.clone().requires_grad_(ctx.tp_rank == 0)).sum().backward()
                with torch.no_grad():
                    model(x)
            else:
                with torch.no_grad():
                    for _ in range(2 - ctx.tp_rank):  # rank 1 stops one pass early
                        model(x)
        except bd.ScheduleMismatch as err:
            return time.monotonic() - start, str(err)
    return time.monotonic() - start, "finished"


@pytest.mark.parametrize("late", [0, 1])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_skipped_last_collective_fails_fast_on_both_ranks_naming_the_pass(where, late):
    # Rank 1 ends the pass (the outermost module's forward, or the backward through it) without the
    # collective rank 0 issues inside it. Caught by whichever rank sees the other first: rank 0
    # waiting reads that rank 1 ended its pass; rank 1 ending it reads that rank 0 waits inside it; or
    # (rank 0 late) rank 1's next collective arrives with that pass among those it ended -- in the
    # forward the very same all-reduce, which would otherwise pair with the skipped one.
    passes = {"forward": "the forward of Sequential", "backward": "the backward through ColumnParallelLinear"}
    for elapsed, message in run_ranks(_skips_the_last_collective, 2, where, late, timeout=60, collective_timeout=50):
        assert elapsed < 5.0, elapsed  # not the check's deadline (20 s), nor gloo's (50 s)
        assert "disagree at collective #0" in message and "rank 0: all_reduce" in message, message
        assert "reached the end of" in message and f"{passes[where]} (from collective #0 on)" in message, message


def test_a_rank_that_stops_early_is_named_at_the_deadline_with_where_it_was():
    (elapsed, message), (_, rank1) = run_ranks(_skips_the_last_collective, 2, "stop", timeout=60,
                                               collective_timeout=50)
    assert rank1 == "finished"
    assert 2.0 <= elapsed < 10.0, elapsed  # the check's deadline, 2 s here
    assert "collective #1 on the TP group" in message and "rank(s) [1] did not reach it within 2 s" in message
    where = "rank 1 issued collective #0 last, then reached the end of the forward of Sequential (from collective #0 on)"
    assert where in message, message


def _enabled_in_a_fresh_process(value):
    env = {k: v for k, v in os.environ.items() if k != "BIGDENSE_CHECK_SCHEDULE"}
    if value is not None:
        env["BIGDENSE_CHECK_SCHEDULE"] = value
    code = "import bigdense.parallel.schedule as s; print(s.enabled())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_schedule_check_is_off_by_default_and_installs_nothing_then():
    assert _enabled_in_a_fresh_process(None).stdout.strip() == "False"
    assert _enabled_in_a_fresh_process("1").stdout.strip() == "True"
    bad = _enabled_in_a_fresh_process("maybe")
    assert bad.returncode != 0 and "BIGDENSE_CHECK_SCHEDULE must be 0 or 1, got 'maybe'" in bad.stderr
    from torch.nn.modules import module as module_hooks

    with bd.check_schedule(False):  # off: no module hook at all; comm tests one flag per collective
        hooks = len(module_hooks._global_forward_pre_hooks)
        with bd.check_schedule():
            assert bd.parallel.schedule.enabled() and len(module_hooks._global_forward_pre_hooks) == hooks + 1
        assert not bd.parallel.schedule.enabled() and len(module_hooks._global_forward_pre_hooks) == hooks
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        bd.check_schedule(timeout=0)


def test_rank_error_reports_the_mismatch():
    # What a user sees from run_ranks (and torchrun): the check's message, not gloo's.
    with pytest.raises(RankError, match="collective schedule check"):
        run_ranks(_mismatch_raises, 2, timeout=60, collective_timeout=50)


def _mismatch_raises():
    elapsed, message = _one_rank_skips("forward")
    raise bd.ScheduleMismatch(message)
