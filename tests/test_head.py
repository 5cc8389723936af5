"""ParallelClassifierHead: loss, gradients and top-k against nn.Linear + F.cross_entropy at tp = 1..4."""
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import bigdense as bd
from bigdense.parallel import comm
from bigdense.testing import run_ranks
from helpers import assert_close

IN = 8
LEAD = (2, 7)  # 14 tokens
N = 14
# fp32: the sharded loss differs from F.cross_entropy only in summation order (per-rank sums
# combined over TP, grad_W accumulated chunk by chunk, grad_h summed over TP) and in computing
# softmax as exp(z - m_rank) * exp(m_rank - lse) instead of exp(z - lse): a few ulps of O(1) values.
FP32 = dict(rtol=1e-5, atol=1e-6)
# bf16 autocast: both sides round the same fp32-accumulated dot products to bf16 (8 significant
# bits). The reference rounds grad_W and grad_b to bf16 once over all tokens; here they are
# accumulated in fp32 over chunks of bf16 products, so they differ by up to one bf16 ulp of the
# reference, 2^-8 relative (measured: 0.015 on grad_W entries of 2.9); a different blocking of the
# chunked matmul can also move a logit by one ulp. rtol of two ulps; atol for entries near zero.
BF16 = dict(rtol=2 ** -7, atol=2 ** -7)


def _data(num_classes, bias, seed, lead=LEAD, ignore=True):
    torch.manual_seed(seed)
    dense = nn.Linear(IN, num_classes, bias=bias)
    h = torch.randn(*lead, IN)
    target = torch.randint(0, num_classes, lead)
    if ignore and target.numel() > 3:
        target.view(-1)[[1, 5]] = -100
    grad_weights = torch.rand(lead)  # per-token upstream gradient for reduction="none"
    return dense, h, target, grad_weights


def _run(loss_fn, h, target, grad_weights, reduction, **kw):
    h = h.clone().requires_grad_()
    loss = loss_fn(h, target, reduction=reduction, **kw)
    (loss * grad_weights if reduction == "none" else loss).sum().backward()
    return loss.detach(), h.grad


def _compare(head, dense, ours, ref, what, tol):
    assert_close(ours[0], ref[0], f"{what} loss", **tol)
    assert_close(ours[1], ref[1], f"{what} grad h", **tol)
    assert_close(head.weight.grad, head.shard_spec("weight").slice_of(dense.weight.grad), f"{what} grad W", **tol)
    if dense.bias is not None:
        assert_close(head.bias.grad, head.shard_spec("bias").slice_of(dense.bias.grad), f"{what} grad b", **tol)


def _reference_loss(dense):
    return lambda h, t, **kw: F.cross_entropy(dense(h).flatten(0, -2).float(), t.flatten(), **kw).view(
        t.shape if kw.get("reduction") == "none" else ()
    )


def _loss_matches_reference(tp):
    bd.init_parallel(tp=tp)
    cases = itertools.product(
        (24, 29, 3),  # classes: divisible by 2 and 4 / uneven at every tp > 1 / fewer than tp=4
        (4, N, N + 6, None),  # chunk: smaller than (not dividing), equal to, larger than the batch; auto
        ("mean", "sum", "none"),
        (0.0, 0.1),
        ("forward", "recompute"),
    )
    for i, (classes, chunk, reduction, eps, strategy) in enumerate(cases):
        dense, h, target, gw = _data(classes, bias=i % 2 == 0, seed=i)
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=chunk, grad_strategy=strategy)
        what = f"tp={tp} classes={classes} chunk={chunk} {reduction} eps={eps} {strategy} bias={dense.bias is not None}"
        ours = _run(head.loss, h, target, gw, reduction, label_smoothing=eps)
        ref = _run(_reference_loss(dense), h, target, gw, reduction, label_smoothing=eps)
        _compare(head, dense, ours, ref, what, FP32)

    # bf16 autocast against F.cross_entropy on the bf16-autocast logits (cast to fp32, as the loss is).
    for i, (classes, reduction) in enumerate(itertools.product((24, 29), ("mean", "none"))):
        dense, h, target, gw = _data(classes, bias=True, seed=100 + i)
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = _run(head.loss, h, target, gw, reduction, label_smoothing=0.1)
            ref = _run(_reference_loss(dense), h, target, gw, reduction, label_smoothing=0.1)
        assert ours[1].dtype == torch.float32 and head.weight.grad.dtype == torch.float32
        _compare(head, dense, ours, ref, f"bf16 autocast tp={tp} classes={classes} {reduction}", BF16)
    # A bf16 model without autocast: bf16 matmuls, fp32 softmax, gradients handed back in bf16.
    dense, h, target, gw = _data(29, bias=True, seed=200)
    dense, h = dense.to(torch.bfloat16), h.to(torch.bfloat16)
    head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=5)
    ours = _run(head.loss, h, target, gw, "mean")
    ref = _run(_reference_loss(dense), h, target, gw, "mean")
    assert ours[0].dtype == torch.float32 and ours[1].dtype == head.weight.grad.dtype == torch.bfloat16
    _compare(head, dense, ours, ref, f"bf16 weights tp={tp}", BF16)


def _edges_are_identical_on_every_rank(tp):
    bd.init_parallel(tp=tp)
    dense, h, target, _ = _data(29, bias=True, seed=7)
    for strategy in ("forward", "recompute"):
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=4, grad_strategy=strategy)
        # Every token ignored: 0, not F.cross_entropy's nan for "mean", and zero gradients.
        for reduction in ("mean", "sum", "none"):
            head.zero_grad(set_to_none=True)
            x = h.clone().requires_grad_()
            loss = head.loss(x, torch.full(LEAD, -100), reduction=reduction, label_smoothing=0.1)
            loss.sum().backward()
            assert torch.equal(loss, torch.zeros_like(loss)), (strategy, reduction, loss)
            for g in (x.grad, head.weight.grad, head.bias.grad):
                assert g is not None and not g.any(), (strategy, reduction)
        # An empty batch.
        for reduction in ("mean", "sum", "none"):
            head.zero_grad(set_to_none=True)
            x = torch.randn(0, IN, requires_grad=True)
            loss = head.loss(x, torch.zeros(0, dtype=torch.long), reduction=reduction)
            loss.sum().backward()
            assert loss.shape == ((0,) if reduction == "none" else ()) and not loss.any()
            assert x.grad.shape == (0, IN) and not head.weight.grad.any()
        values, ids = head.predict(torch.randn(0, 3, IN), k=2)
        assert values.shape == ids.shape == (0, 3, 2)
    # A bad label raises on every rank, before any collective, naming the label.
    head = bd.ParallelClassifierHead.from_dense(dense)
    for bad in (29, -1):
        t = target.clone()
        t[1, 3] = bad
        named = rf"ParallelClassifierHead\(in_features=8, num_classes=29, tp={tp}.*"
        with pytest.raises(ValueError, match=named + rf"label {bad} is outside \[0, 29\)"):
            head.loss(h, t)
    with pytest.raises(ValueError, match="target shape"):
        head.loss(h, target[:, :3])
    with pytest.raises(TypeError, match="integer class ids"):
        head.loss(h, target.float())
    # The run goes on: no rank is stuck in a collective.
    assert torch.isfinite(head.loss(h, target))
    # Backward twice through a loss whose gradients were formed in the forward is refused clearly.
    loss = head.loss(h.clone().requires_grad_(), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    return head.loss(h, target, reduction="none").tolist()


def _reference_topk(logits, k):
    # Ties to the lower class id: a stable descending sort keeps equal values in id order.
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    return logits.gather(-1, order), order


def _predict_matches_reference(tp):
    bd.init_parallel(tp=tp)
    for classes, k, chunk in ((29, 1, 4), (29, 5, None), (24, 24, 3), (3, 3, 5), (29, 29, 100)):
        dense, h, _, _ = _data(classes, bias=True, seed=classes + k)
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
    dense, h, target, _ = _data(29, bias=True, seed=1)
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
        _loss_matches_reference(1)  # in this process: no process group at all
    else:
        run_ranks(_loss_matches_reference, tp, tp, timeout=240)


@pytest.mark.parametrize("tp", [1, 3])
def test_edges_are_defined_and_identical_on_every_rank(tp):
    fn = _edges_are_identical_on_every_rank
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
    import bigdense.layers.head.ce_chunks as ce_chunks
    import bigdense.layers.head.ce_gpu as ce_gpu

    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(16, 37, chunk_size=4)
    h, target = torch.randn(10, 16, requires_grad=True), torch.randint(0, 37, (10,))
    expected = head.loss(h, target)
    calls = []
    for loop in (ce_chunks, ce_gpu):  # whichever loop runs (tests/test_head_kernels.py forces the GPU one)
        monkeypatch.setattr(loop, "chunk_grads", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        assert torch.equal(head.loss(h, target), expected.detach())
    assert not calls
