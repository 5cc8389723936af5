"""The head's logit options -- ``softcap``, ``z_loss`` -- and the token accuracy counted from the same statistics,
against references built on the full logits (F.cross_entropy, torch.logsumexp, argmax), at tp 1-3
(uneven shards), on the CPU loop and on the GPU loop with its Triton kernels run by the interpreter;
and the softmax's precision at logits near 1e4.

Tolerances: fp32 against fp32 references that sum the same terms in another order (the chunked,
sharded softmax against one logsumexp over the row): a few ulps of O(1) values, 1e-5 relative allowed.
Accuracy and token counts are integers: exact.
"""
import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.kernels import softmax_ce
from bigdense.kernels.softmax_ce import KERNELS_ENV, STATS
from bigdense.testing import run_ranks

D, CLASSES, N = 12, 29, 40  # 29 classes: uneven over 2 and 3 ranks
LOOPS = ("off", "triton")  # the CPU loop; the GPU loop with the interpreted Triton kernels
CASES = [  # softcap, z_loss, label smoothing, reduction, bias
    (0.0, 0.0, 0.0, "mean", False),
    (4.0, 0.0, 0.0, "mean", True),
    (0.0, 1e-2, 0.0, "sum", False),
    (4.0, 1e-2, 0.1, "mean", True),
    (2.5, 3e-3, 0.0, "none", False),
]
# The interpreter is slow: the GPU loop runs the cases that switch each kernel option on (the
# softcap, the z-loss, both with smoothing and a bias, the recompute backward of "none").
TRITON_CASES = (1, 2, 3, 4)


def _reference(h, w, b, target, softcap, z_loss, eps, reduction):
    """The full-logit loss of one rank holding everything, float64."""
    z = h @ w.t() + (b if b is not None else 0.0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = target != -100
    per_token = F.cross_entropy(z, target, label_smoothing=eps, reduction="none") + z_loss * torch.logsumexp(z, -1) ** 2
    per_token = torch.where(valid, per_token, 0.0)
    loss = per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum() if reduction == "sum" else per_token
    correct = int(((z.argmax(-1) == target) & valid).sum())  # random logits: no ties
    z_sum = float((torch.where(valid, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)).sum())
    return loss, correct, int(valid.sum()), z_sum


def _options_match_full_logits(tp):
    import os

    ctx = bd.init_parallel(tp=tp)
    out = []
    for loop in LOOPS:
        os.environ[KERNELS_ENV] = loop
        for case, (softcap, z_loss, eps, reduction, bias) in enumerate(CASES):
            if loop == "triton" and case not in TRITON_CASES:
                continue
            torch.manual_seed(case)
            head = bd.ParallelClassifierHead(D, CLASSES, bias=bias, chunk_size=16, softcap=softcap, z_loss=z_loss,
                                             tp_group=ctx.tp_group)
            g = torch.Generator().manual_seed(10 + case)
            h = (torch.randn(N, D, generator=g) * 2).requires_grad_()
            target = torch.randint(0, CLASSES, (N,), generator=g)
            target[::5] = -100
            with bd.collect_loss_metrics() as seen:
                loss = head.loss(h, target, label_smoothing=eps, reduction=reduction)
            (loss.sum() if reduction == "none" else loss).backward()
            full_w = head.to_dense()
            w64 = full_w.weight.detach().double().requires_grad_()
            b64 = full_w.bias.detach().double().requires_grad_() if bias else None
            h64 = h.detach().double().requires_grad_()
            want, correct, tokens, z_sum = _reference(h64, w64, b64, target, softcap, z_loss, eps, reduction)
            (want.sum() if reduction == "none" else want).backward()
            what = f"tp={tp} loop={loop} case={case}"
            lo, hi = head.class_start, head.class_start + head.classes_local
            pairs = [(loss, want), (h.grad, h64.grad), (head.weight.grad, w64.grad[lo:hi])]
            if bias:
                pairs.append((head.bias.grad, b64.grad[lo:hi]))
            for got, ref in pairs:
                torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5 * float(ref.abs().max()),
                                           msg=lambda m: f"{what}: {m}")
            assert (int(seen.tokens), int(seen.correct)) == (tokens, correct), what
            assert abs(float(seen.z_loss) - z_sum) <= 1e-5 * max(z_sum, 1.0), what
            out.append(what)
    return out


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_softcap_z_loss_and_accuracy_match_full_logits_on_both_loops(tp):
    done = run_ranks(_options_match_full_logits, tp, tp, timeout=300)
    assert all(len(rank) == len(CASES) + len(TRITON_CASES) for rank in done)


def _accuracy_with_ties(tp):
    # Rows of the weight repeated across ranks: every token's largest logit is held by three
    # classes, one of them its target. The accuracy counts a tie for the largest as right (argmax
    # would pick the lowest id: right for two of the six tokens); a target below the largest is wrong.
    ctx = bd.init_parallel(tp=tp)
    head = bd.ParallelClassifierHead(4, 6, bias=False, tp_group=ctx.tp_group)
    full = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]] * 3)  # classes 0,2,4 alike; 1,3,5 alike
    with torch.no_grad():
        head.weight.copy_(full[head.class_start: head.class_start + head.classes_local])
    h = torch.tensor([[2.0, 0, 0, 0]] * 3 + [[0, 3.0, 0, 0]] * 3 + [[1.0, 0, 0, 0]])
    target = torch.tensor([0, 2, 4, 1, 3, 5, 1])
    with bd.collect_loss_metrics() as seen:
        head.loss(h, target)
    z = h @ full.t()
    is_largest = z.gather(1, target.unsqueeze(1)).squeeze(1) == z.amax(dim=1)
    return int(seen.correct), int(is_largest.sum())


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_accuracy_counts_a_tie_for_the_largest_logit_as_right(tp):
    for got, want in run_ranks(_accuracy_with_ties, tp, tp):
        assert got == want == 6


def _large_logit_errors():
    """Each loop's fp32 input gradient at logits near 1e4, against float64, beside F.cross_entropy's
    own fp32 error. Integer weights and inputs make the logits exact in fp32, so the errors are the
    softmax's alone."""
    import os

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    head = bd.ParallelClassifierHead(8, 300, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randint(-250, 250, (300, 8), generator=g).float())
    h = torch.randint(-20, 20, (64, 8), generator=g).float()
    target = torch.randint(0, 300, (64,), generator=g)
    w = head.weight.detach()
    h64 = h.double().requires_grad_()
    F.cross_entropy(h64 @ w.double().t(), target).backward()
    h32 = h.clone().requires_grad_()
    F.cross_entropy(h32 @ w.t(), target).backward()
    errors = {"F.cross_entropy": float((h32.grad.double() - h64.grad).abs().max()),
              "largest logit": float((h @ w.t()).abs().max())}
    for loop in LOOPS:
        os.environ[KERNELS_ENV] = loop
        ours = h.clone().requires_grad_()
        head.loss(ours, target).backward()
        errors[loop] = float((ours.grad.double() - h64.grad).abs().max())
    return errors


def test_the_fp32_gradient_at_logits_near_1e4_is_as_precise_as_cross_entropy():
    # The softmax is exp((z - M) - log S), not exp(z - lse): an fp32 lse near 1e4 is itself off by
    # ~1e-3, which exp turned into a 1000x larger gradient error than F.cross_entropy's.
    errors = run_ranks(_large_logit_errors, 1)[0]
    assert errors["largest logit"] > 9e3, errors
    for loop in LOOPS:
        assert errors[loop] <= 10 * errors["F.cross_entropy"], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_with_softcap_and_z_loss_equal_their_torch_references(dtype):
    from bigdense.kernels import triton_ce

    g = torch.Generator().manual_seed(5)
    z = (torch.randn(6, 37, generator=g) * 8).to(dtype)
    target = torch.randint(-1, 37, (6,), generator=g)
    weight = torch.rand(6, generator=g)
    stats_ref = softmax_ce.row_stats(z, target, None, None, True, torch.empty(STATS, 6), softcap=5.0)
    stats = triton_ce.row_stats(z, target, None, None, True, torch.empty(STATS, 6), softcap=5.0, block=16)
    # fp32 both sides; the kernel's tanh (from exp) is within a few ulps of torch's.
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-6)
    every = torch.stack([stats_ref, stats_ref - torch.tensor([1.0, 0, 0, 0]).unsqueeze(1)])
    smooth = torch.tensor(0.1 / 37)
    want = softmax_ce.softmax_grad_(z.clone(), every, target, None, None, weight, 0.1, smooth, softcap=5.0, z_loss=1e-2)
    got = triton_ce.softmax_grad_(z.clone(), every, target, None, None, weight, 0.1, smooth, softcap=5.0, z_loss=1e-2,
                                  block=16)
    # bf16: the interpreter truncates the stored gradient where the reference rounds to nearest
    # (GPUs round to nearest too): one bf16 rounding step, 2^-7 relative, apart at most.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"ParallelClassifierHead\(in_features=4, num_classes=5\): softcap must be"):
        bd.ParallelClassifierHead(4, 5, softcap=-1.0)
    with pytest.raises(ValueError, match="z_loss must be a finite number"):
        bd.ParallelClassifierHead(4, 5).loss(torch.randn(2, 4), torch.tensor([0, 1]), z_loss=float("inf"))
    with pytest.raises(ValueError, match="margin=.arcface. sets the logits to scale"):
        bd.ParallelClassifierHead(4, 5, bias=False, margin="arcface", softcap=30.0)
