"""The classifier head's exactness cases against nn.Linear + F.cross_entropy, shared by two test files:
tests/test_head.py runs them on the head's CPU loop, tests/test_head_kernels.py on its GPU loop (the
Triton kernels, interpreted on CPU). The rank functions are module-level so that run_ranks can start
them in its ranks; the batches and tolerances they use are here too, with the references they compare to."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
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


def dense_and_batch(num_classes, bias, seed, lead=LEAD, ignore=True):
    """A dense reference layer, inputs, targets (two ignored) and per-token upstream gradients."""
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


def loss_matches_reference(tp):
    bd.init_parallel(tp=tp)
    cases = itertools.product(
        (24, 29, 3),  # classes: divisible by 2 and 4 / uneven at every tp > 1 / fewer than tp=4
        (4, N, N + 6, None),  # chunk: smaller than (not dividing), equal to, larger than the batch; auto
        ("mean", "sum", "none"),
        (0.0, 0.1),
        ("forward", "recompute"),
    )
    for i, (classes, chunk, reduction, eps, strategy) in enumerate(cases):
        dense, h, target, gw = dense_and_batch(classes, bias=i % 2 == 0, seed=i)
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=chunk, grad_strategy=strategy)
        what = f"tp={tp} classes={classes} chunk={chunk} {reduction} eps={eps} {strategy} bias={dense.bias is not None}"
        ours = _run(head.loss, h, target, gw, reduction, label_smoothing=eps)
        ref = _run(_reference_loss(dense), h, target, gw, reduction, label_smoothing=eps)
        _compare(head, dense, ours, ref, what, FP32)

    # bf16 autocast against F.cross_entropy on the bf16-autocast logits (cast to fp32, as the loss is).
    for i, (classes, reduction) in enumerate(itertools.product((24, 29), ("mean", "none"))):
        dense, h, target, gw = dense_and_batch(classes, bias=True, seed=100 + i)
        head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = _run(head.loss, h, target, gw, reduction, label_smoothing=0.1)
            ref = _run(_reference_loss(dense), h, target, gw, reduction, label_smoothing=0.1)
        assert ours[1].dtype == torch.float32 and head.weight.grad.dtype == torch.float32
        _compare(head, dense, ours, ref, f"bf16 autocast tp={tp} classes={classes} {reduction}", BF16)
    # A bf16 model without autocast: bf16 matmuls, fp32 softmax, gradients handed back in bf16.
    dense, h, target, gw = dense_and_batch(29, bias=True, seed=200)
    dense, h = dense.to(torch.bfloat16), h.to(torch.bfloat16)
    head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=5)
    ours = _run(head.loss, h, target, gw, "mean")
    ref = _run(_reference_loss(dense), h, target, gw, "mean")
    assert ours[0].dtype == torch.float32 and ours[1].dtype == head.weight.grad.dtype == torch.bfloat16
    _compare(head, dense, ours, ref, f"bf16 weights tp={tp}", BF16)


def edges_are_identical_on_every_rank(tp):
    bd.init_parallel(tp=tp)
    dense, h, target, _ = dense_and_batch(29, bias=True, seed=7)
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


def no_grad_evaluation_forms_no_gradients(monkeypatch):
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
