"""Sequence-parallel layers (a column/row linear pair, both MLPs, the embedding and the classifier head)
against unsharded twins written here, shared by two test files: tests/test_sequence_parallel.py runs
them with the head on its CPU loop, tests/test_head_kernels.py with the head on its GPU loop (the
Triton kernels, interpreted on CPU). The rank function is module-level so that run_ranks can start it
in its ranks; the sizes, tolerance and sequence shares it uses are here too."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.parallel import comm
from helpers import assert_close

# fp32: the only differences from the twin are the order of the TP sums (reduce-scatter, the
# re-gathered weight-gradient GEMM over the same rows): a few ulps of O(1) values.
FP32 = dict(rtol=1e-5, atol=1e-6)
B, D_IN, D_OUT = 2, 5, 7


def rank_share(x, ctx, dim=-2):
    """This rank's balanced share of ``x`` along ``dim`` (a copy, as a fresh leaf if x needs grad)."""
    out = comm.split_dim(x.detach(), dim, ctx.tp_group).clone()
    return out.requires_grad_(x.requires_grad)


def _full(t, ctx, dim):
    return comm.all_gather_dim(t.detach(), dim, ctx.tp_group)


def _linear_pair(ctx, S):
    ref_col, ref_row = nn.Linear(D_IN, D_OUT), nn.Linear(D_OUT, D_IN)
    col = bd.ColumnParallelLinear.from_dense(ref_col, sequence_parallel=True)
    row = bd.RowParallelLinear.from_dense(ref_row, sequence_parallel=True)
    x = torch.randn(B, S, D_IN, requires_grad=True)
    x_local = rank_share(x, ctx)
    # Column: (B, S_local, in) -> (B, S, out_local)
    y_ref = ref_col(x)
    y = col(x_local, seq_len=S)
    assert y.shape == (B, S, col.partition_size)
    assert_close(_full(y, ctx, -1), y_ref.detach(), "column output", **FP32)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y.backward(comm.split_dim(g, -1, ctx.tp_group))
    assert_close(x_local.grad, rank_share(x.grad, ctx), "column input grad", **FP32)
    assert_close(_full(col.weight.grad, ctx, 0), ref_col.weight.grad, "column weight grad", **FP32)
    assert_close(_full(col.bias.grad, ctx, 0), ref_col.bias.grad, "column bias grad", **FP32)
    # Row: (B, S, in_local) -> (B, S_local, out), its replicated bias's gradient whole on every rank
    h = torch.randn(B, S, D_OUT, requires_grad=True)
    h_local = rank_share(h, ctx, -1)
    z_ref, z = ref_row(h), row(h_local)
    assert_close(z, rank_share(z_ref, ctx).detach(), "row output", **FP32)
    g = torch.randn_like(z_ref)
    z_ref.backward(g)
    z.backward(rank_share(g, ctx))
    assert_close(h_local.grad, rank_share(h.grad, ctx, -1), "row input grad", **FP32)
    assert_close(_full(row.weight.grad, ctx, 1), ref_row.weight.grad, "row weight grad", **FP32)
    assert_close(row.bias.grad, ref_row.bias.grad, "row bias grad (replicated)", **FP32)


def _mlp(ctx, S, activation):
    linears = [nn.Linear(D_IN, 9), nn.Linear(D_IN, 9), nn.Linear(9, D_IN)]  # gate, up, down
    gate, up, down = linears
    used = linears if activation == "swiglu" else [up, down]
    mlp = bd.ParallelMLP.from_dense(*used, activation=activation, sequence_parallel=True)
    x = torch.randn(B, S, D_IN, requires_grad=True)
    x_local = rank_share(x, ctx)
    hidden = F.silu(gate(x)) * up(x) if activation == "swiglu" else F.gelu(up(x))
    y_ref = down(hidden)
    y = mlp(x_local)  # no seq_len: the ranks exchange their lengths
    assert_close(y, rank_share(y_ref, ctx).detach(), f"{activation} MLP output", **FP32)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y.backward(rank_share(g, ctx))
    assert_close(x_local.grad, rank_share(x.grad, ctx), f"{activation} MLP input grad", **FP32)
    assert_close(_full(mlp.up.weight.grad, ctx, 0), up.weight.grad, "MLP up weight grad", **FP32)
    assert_close(_full(mlp.down.weight.grad, ctx, 1), down.weight.grad, "MLP down weight grad", **FP32)
    assert_close(mlp.down.bias.grad, down.bias.grad, "MLP down bias grad (replicated)", **FP32)


def _embedding_and_head(ctx, S):
    vocab = 11
    ref_emb, ref_head = nn.Embedding(vocab, D_IN), nn.Linear(D_IN, vocab)
    emb = bd.VocabParallelEmbedding.from_dense(ref_emb, sequence_parallel=True)
    head = bd.ParallelClassifierHead(D_IN, vocab, sequence_parallel=True, chunk_size=3)
    head.load_dense_(ref_head.weight, ref_head.bias)
    ids = torch.randint(0, vocab, (B, S))
    target = torch.randint(0, vocab, (B, S))
    e_ref = ref_emb(ids)
    e = emb(ids)
    assert_close(e, rank_share(e_ref, ctx).detach(), "embedding output", **FP32)
    loss_ref = F.cross_entropy(ref_head(e_ref).flatten(0, 1), target.flatten())
    loss = head.loss(e, target)
    assert_close(loss, loss_ref.detach(), "head loss", **FP32)
    loss_ref.backward()
    loss.backward()
    assert_close(_full(emb.weight.grad, ctx, 0), ref_emb.weight.grad, "embedding weight grad", **FP32)
    assert_close(_full(head.weight.grad, ctx, 0), ref_head.weight.grad, "head weight grad", **FP32)
    scores, classes = head.predict(rank_share(e_ref, ctx).detach(), k=2)
    assert_close(scores, ref_head(e_ref).detach().topk(2).values, "head top-2", **FP32)


def layers_match(tp):
    ctx = bd.init_parallel(tp=tp)
    for S in (7, 2):  # 7: uneven at tp 2, 3, 4; 2: empty shares at tp 3, 4
        torch.manual_seed(S)
        _linear_pair(ctx, S)
        for activation in ("gelu", "swiglu"):
            _mlp(ctx, S, activation)
        _embedding_and_head(ctx, S)
    return True
