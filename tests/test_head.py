"""ParallelClassifierHead: loss, gradients and top-k against nn.Linear + F.cross_entropy at tp = 1..4."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import bigdense as bd
from bigdense.parallel import comm
from bigdense.testing import run_ranks
from head_cases import (
    FP32, IN, LEAD, N, dense_and_batch, edges_are_identical_on_every_rank, loss_matches_reference,
    no_grad_evaluation_forms_no_gradients,
)
from helpers import assert_close


def _reference_topk(logits, k):
    # Ties to the lower class id: a stable descending sort keeps equal values in id order.
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    return logits.gather(-1, order), order


def _predict_matches_reference(tp):
    bd.init_parallel(tp=tp)
    for classes, k, chunk in ((29, 1, 4), (29, 5, None), (24, 24, 3), (3, 3, 5), (29, 29, 100)):
        dense, h, _, _ = dense_and_batch(classes, bias=True, seed=classes + k)
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=chunk)
        values, ids = head.predict(h, k=k)
        ref_values, ref_ids = _reference_topk(dense(h).detach(), k)
        assert ids.shape == values.shape == LEAD + (k,)
        # Random logits are far apart compared with fp32 matmul rounding, so the ids are exact.
        assert torch.equal(ids, ref_ids), (classes, k, ids, ref_ids)
        assert_close(values, ref_values, "top-k values", **FP32)
    # Many exact ties: small integer weights and inputs make every logit an exact small integer.
    torch.manual_seed(3)
    dense = nn.Linear(IN, 30, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randint(-1, 2, dense.weight.shape).float())
    h = torch.randint(-1, 2, (40, IN)).float()
    head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=16)
    for k in (1, 4, 11):
        values, ids = head.predict(h, k=k)
        ref_values, ref_ids = _reference_topk(dense(h).detach(), k)
        assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids), (k, ids, ref_ids)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 30\]"):
        head.predict(h, k=31)
    return ids.tolist()


def _count_calls(targets):
    """Wrap ``owner.name`` for each ``(owner, name, key)`` (inside a rank: the process ends after)."""
    counts = {key: 0 for _, _, key in targets}

    def wrap(owner, name, key):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for owner, name, key in targets:
        wrap(owner, name, key)
    return counts


def _collectives_per_chunk(tp):
    bd.init_parallel(tp=tp)
    counts = _count_calls([(dist, "all_reduce", "all_reduce"), (comm, "_all_gather_single", "all_gather")])
    dense, h, target, _ = dense_and_batch(29, bias=True, seed=1)
    out = {}
    for strategy in ("forward", "recompute"):
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=4, grad_strategy=strategy)
        x = h.clone().requires_grad_()
        counts.update(all_reduce=0, all_gather=0)
        loss = head.loss(x, target)
        forward = dict(counts)
        counts.update(all_reduce=0, all_gather=0)
        loss.backward()
        out[strategy] = (forward, dict(counts))
    return out


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_loss_and_grads_match_cross_entropy(tp):
    if tp == 1:
        loss_matches_reference(1)  # in this process: no process group at all
    else:
        run_ranks(loss_matches_reference, tp, tp, timeout=240)


@pytest.mark.parametrize("tp", [1, 3])
def test_edges_are_defined_and_identical_on_every_rank(tp):
    fn = edges_are_identical_on_every_rank
    results = [fn(1)] if tp == 1 else run_ranks(fn, tp, tp)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_predict_is_the_global_top_k_with_ties_to_the_lower_id(tp):
    results = [_predict_matches_reference(1)] if tp == 1 else run_ranks(_predict_matches_reference, tp, tp)
    assert all(r == results[0] for r in results)


def test_one_all_gather_per_chunk_and_one_all_reduce_of_grad_h():
    chunks = -(-N // 4)  # 4 chunks of at most 4 tokens
    for rank in run_ranks(_collectives_per_chunk, 2, 2):
        assert rank["forward"] == ({"all_reduce": 1, "all_gather": chunks}, {"all_reduce": 0, "all_gather": 0})
        assert rank["recompute"] == ({"all_reduce": 0, "all_gather": chunks}, {"all_reduce": 1, "all_gather": 0})


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_the_logits_never_exist_beyond_one_chunk(strategy):
    # Few features, many tokens: then tokens x classes dwarfs every other tensor of the head.
    tokens, classes, features, chunk = 256, 40, 4, 8
    head = bd.ParallelClassifierHead(features, classes, chunk_size=chunk, grad_strategy=strategy)
    h = torch.randn(tokens, features, requires_grad=True)
    target = torch.randint(0, classes, (tokens,))
    with _LargestTensor() as mode:
        head.loss(h, target, label_smoothing=0.1).backward()
    assert h.grad is not None and head.weight.grad is not None
    # The largest tensors allowed: one chunk of logits, or h / its grad.
    assert mode.largest <= max(chunk * classes, tokens * features), mode.largest
    assert mode.largest < tokens * classes


def test_init_is_tp_invariant_and_meta_materialises_the_same():
    torch.manual_seed(11)
    reference = bd.ParallelClassifierHead(IN, 29).to_dense()
    gathered = run_ranks(_gather_fresh_head, 3, 3)
    for weight, bias in gathered:
        assert torch.equal(weight, reference.weight) and torch.equal(bias, reference.bias)
    torch.manual_seed(11)
    meta = bd.ParallelClassifierHead(IN, 29, device="meta")
    bd.materialize(meta)
    assert torch.equal(meta.weight, reference.weight) and torch.equal(meta.bias, reference.bias)


def _gather_fresh_head(tp):
    bd.init_parallel(tp=tp)
    torch.manual_seed(11)
    head = bd.ParallelClassifierHead(IN, 29)
    assert head.bd_shard_specs()["weight"].sizes == (10, 10, 9) and set(head.bd_shard_specs()) == {"weight", "bias"}
    dense = head.to_dense()
    return dense.weight.detach(), dense.bias.detach()


# ---- tied input/output embeddings ----
VOCAB, DIM = 23, 6


class _TiedReference(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def loss(self, ids, target):
        return F.cross_entropy(self.head(torch.tanh(self.emb(ids))).flatten(0, 1), target.flatten())


def _tied_matches_reference(tp):
    bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    ref = _TiedReference()
    ids, target = torch.randint(0, VOCAB, (3, 5)), torch.randint(0, VOCAB, (3, 5))
    emb = bd.VocabParallelEmbedding.from_dense(ref.emb)
    head = bd.tie_weights(emb, bd.ParallelClassifierHead(DIM, VOCAB, bias=False, chunk_size=4))
    assert head.weight is emb.weight and len(list(nn.ModuleList([emb, head]).parameters())) == 1
    loss = head.loss(torch.tanh(emb(ids)), target)
    loss.backward()
    ref_loss = ref.loss(ids, target)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "tied loss", **FP32)
    # One shard, receiving both the embedding's and the head's gradients.
    assert_close(emb.weight.grad, emb.shard_spec("weight").slice_of(ref.emb.weight.grad), "tied grad", **FP32)

    # Built on meta and materialised: still tied, holding the embedding's initialisation.
    torch.manual_seed(1)
    eager = bd.VocabParallelEmbedding(VOCAB, DIM)
    torch.manual_seed(1)
    emb = bd.VocabParallelEmbedding(VOCAB, DIM, device="meta")
    head = bd.tie_weights(emb, bd.ParallelClassifierHead(DIM, VOCAB, bias=False, device="meta"))
    model = bd.materialize(nn.ModuleList([head, emb]))  # the head first: it must not overwrite
    assert head.weight is emb.weight and torch.equal(emb.weight, eager.weight)
    with pytest.raises(ValueError, match="needs .num_classes, in_features. = .22, 6."):
        bd.tie_weights(emb, bd.ParallelClassifierHead(DIM, VOCAB - 1))
    return model is not None


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_tied_embedding_and_head_share_one_shard(tp):
    if tp == 1:
        _tied_matches_reference(1)
    else:
        run_ranks(_tied_matches_reference, tp, tp)


def test_bad_arguments_are_named():
    head = bd.ParallelClassifierHead(IN, 5)
    named = r"ParallelClassifierHead\(in_features=8, num_classes=5.*"
    with pytest.raises(ValueError, match=named + r"expected input of shape \(\*, 8\)"):
        head.loss(torch.randn(3, 7), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be one of"):
        head.loss(torch.randn(3, IN), torch.zeros(3, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="num_classes must be a positive integer"):
        bd.ParallelClassifierHead(IN, 0)
    with pytest.raises(ValueError, match="grad_strategy"):
        bd.ParallelClassifierHead(IN, 5, grad_strategy="later")


def test_no_grad_evaluation_forms_no_gradients(monkeypatch):
    """Under no_grad (evaluation) the loss is the same, and not one gradient matmul runs."""
    no_grad_evaluation_forms_no_gradients(monkeypatch)
