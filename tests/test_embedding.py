"""VocabParallelEmbedding against nn.Embedding at tp = 1..4: values, gradients, padding, bad ids."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import bigdense as bd
from bigdense.testing import run_ranks
from helpers import assert_close

DIM = 5
# Weight gradients: the sharded layer sums the same upstream rows into each table row as
# nn.Embedding does, but its backward may visit duplicate ids in another order: fp32 rounding of
# sums of a few O(1) terms.
GRAD = dict(rtol=1e-6, atol=1e-6)

CASES = [
    # (num_embeddings, padding_idx, ids shape): even / uneven splits, padding on any rank, fewer rows than tp=4.
    (24, None, (3, 5)),
    (29, 3, (2, 3, 4)),
    (29, -1, (40,)),
    (29, 20, (4, 6)),
    (3, None, (7,)),
    (3, 2, (2, 2)),
]


def _embedding_matches_reference(tp):
    bd.init_parallel(tp=tp)
    calls = {"fwd": 0}
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls["fwd"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted  # inside the rank process only
    for i, (rows, padding_idx, shape) in enumerate(CASES):
        torch.manual_seed(i)
        ref = nn.Embedding(rows, DIM, padding_idx=padding_idx)
        ids = torch.randint(0, rows, shape)
        ids.view(-1)[:2] = torch.tensor([0, rows - 1])  # both ends of the table
        if padding_idx is not None:
            ids.view(-1)[2] = padding_idx % rows
        upstream = torch.randn(*shape, DIM)
        emb = bd.VocabParallelEmbedding.from_dense(ref)
        assert emb.padding_idx == ref.padding_idx

        calls["fwd"] = 0
        out = emb(ids)
        assert calls["fwd"] == (1 if tp > 1 else 0), calls
        # Each output row is one table row plus exact zeros from the other ranks: bit-identical.
        assert torch.equal(out, ref(ids)), (tp, rows)
        calls["fwd"] = 0
        (out * upstream).sum().backward()
        assert calls["fwd"] == 0  # the backward needs no collective
        (ref(ids) * upstream).sum().backward()
        expected = emb.shard_spec("weight").slice_of(ref.weight.grad)
        assert_close(emb.weight.grad, expected, f"tp={tp} rows={rows} grad", **GRAD)
        if padding_idx is not None:
            assert not ref.weight.grad[padding_idx].any()  # the reference's contract, which we match above
        assert torch.equal(emb.to_dense().weight, ref.weight)

        for bad in (rows, -1, rows + 100):
            bad_ids = ids.clone()
            bad_ids.view(-1)[-1] = bad
            named = rf"VocabParallelEmbedding\(num_embeddings={rows}, embedding_dim={DIM}, tp={tp}, rank \d\): "
            with pytest.raises(ValueError, match=named + rf"id {bad} is outside \[0, {rows}\)"):
                emb(bad_ids)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        emb(torch.zeros(3))
    assert emb(torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4, DIM)
    return out.tolist()


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_embedding_matches_nn_embedding(tp):
    results = [_embedding_matches_reference(1)] if tp == 1 else run_ranks(_embedding_matches_reference, tp, tp)
    assert all(r == results[0] for r in results)  # replicated output


def _gather_fresh(tp, rows, padding_idx):
    bd.init_parallel(tp=tp)
    torch.manual_seed(4)
    emb = bd.VocabParallelEmbedding(rows, DIM, padding_idx=padding_idx)
    assert set(emb.bd_shard_specs()) == {"weight"} and emb.bd_shard_specs()["weight"].dim == 0
    return emb.to_dense().weight.detach()


@pytest.mark.parametrize("rows,padding_idx", [(29, 7), (24, None)])
def test_init_is_tp_invariant_and_meta_materialises_the_same(rows, padding_idx):
    torch.manual_seed(4)
    single = bd.VocabParallelEmbedding(rows, DIM, padding_idx=padding_idx).weight.detach()
    # nn.Embedding's law: N(0, 1), the padding row zero.
    assert abs(single.std().item() - 1.0) < 0.3  # 145 draws: the std's std is ~0.06; 5 sigma
    if padding_idx is not None:
        assert not single[padding_idx].any()
    for full in run_ranks(_gather_fresh, 3, 3, rows, padding_idx):
        assert torch.equal(full, single)
    torch.manual_seed(4)
    meta = bd.materialize(bd.VocabParallelEmbedding(rows, DIM, padding_idx=padding_idx, device="meta"))
    assert torch.equal(meta.weight, single)


def test_from_dense_refuses_what_it_cannot_shard():
    with pytest.raises(ValueError, match="max_norm"):
        bd.VocabParallelEmbedding.from_dense(nn.Embedding(5, 3, max_norm=1.0))
    with pytest.raises(TypeError, match="expected an nn.Embedding"):
        bd.VocabParallelEmbedding.from_dense(nn.Linear(3, 5))
    with pytest.raises(ValueError, match="padding_idx must be in"):
        bd.VocabParallelEmbedding(5, 3, padding_idx=5)
