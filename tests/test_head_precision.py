"""ParallelClassifierHead under fp16 autocast with loss scaling, and with host checks off."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.testing import run_ranks
from bigdense.train.precision import DynamicLossScaler

IN, CLASSES = 64, 50
# A confident model (the target's probability ~0.98, as late in training) and a mean over this
# many tokens: every per-logit gradient (p - onehot) / n_valid is then below fp16's smallest normal
# number (6.1e-5) before the loss scale multiplies it, most below 1e-6: the case that loses most
# of its bits or flushes to zero if the per-token factor is applied in fp16.
TOKENS = 2048
# fp16 keeps 11 significant bits: h and W are rounded to fp16 (2^-11 = 4.9e-4 relative each)
# before fp32-accumulated matmuls whose results are rounded to fp16 again. For confident tokens
# grad_b and the loss are differences of nearly equal numbers (p_t - 1), which magnifies the
# rounding of a logit of 8 (measured: 2.4e-3 normwise on grad_b, 1.8e-3 on grad_h). 4e-3 is
# above that; applying 1/n_valid in fp16 before the scale gives 1.9e-2 on grad_h.
FP16_REL = 4e-3


def _rel(actual, expected):
    return float((actual.float() - expected).norm() / expected.norm())


def _fp16_matches_fp32(tp, strategy, reduction):
    if tp > 1:
        bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    dense = nn.Linear(IN, CLASSES)
    nn.init.orthogonal_(dense.weight)  # unit rows: the target's logit is 8, the others about 0
    target = torch.randint(0, CLASSES, (TOKENS,))
    h = 8.0 * dense.weight.detach()[target] + 0.1 * torch.randn(TOKENS, IN)
    target[::7] = -100
    upstream = torch.rand(TOKENS)  # per-token gradient for reduction="none"

    def run(loss_fn, scale):
        x = h.clone().requires_grad_()
        loss = loss_fn(x)
        total = loss if reduction == "mean" else (loss * upstream).sum() / TOKENS
        (total * scale).backward()
        return loss.detach(), x.grad / scale

    ref_loss, ref_gh = run(lambda x: F.cross_entropy(dense(x), target, reduction=reduction), 1.0)
    ref_gw, ref_gb = dense.weight.grad, dense.bias.grad

    head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=512, grad_strategy=strategy)
    scaler = DynamicLossScaler(init_scale=2.0**16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss, gh = run(lambda x: head.loss(x, target, reduction=reduction), scaler.get_scale())
    assert not scaler.unscale_(head.parameters())
    spec_w, spec_b = head.shard_spec("weight"), head.shard_spec("bias")
    errors = {
        "loss": _rel(loss, ref_loss), "grad h": _rel(gh, ref_gh),
        "grad W": _rel(head.weight.grad, spec_w.slice_of(ref_gw)), "grad b": _rel(head.bias.grad, spec_b.slice_of(ref_gb)),
    }
    # The smallest per-token gradients really are below fp16's normal range before scaling.
    assert float(ref_gh.abs()[ref_gh != 0].min()) < torch.finfo(torch.float16).tiny
    return errors


@pytest.mark.parametrize("strategy,reduction", [("forward", "mean"), ("recompute", "mean"), ("recompute", "none")])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp16_loss_and_gradients_match_fp32(tp, strategy, reduction):
    results = [_fp16_matches_fp32(1, strategy, reduction)] if tp == 1 else run_ranks(
        _fp16_matches_fp32, tp, tp, strategy, reduction)
    for errors in results:
        assert all(e < FP16_REL for e in errors.values()), (strategy, reduction, errors)


def test_bad_labels_with_checks_off_give_nan_not_a_wrong_number():
    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(8, 10, chunk_size=3)
    h = torch.randn(6, 8, requires_grad=True)
    target = torch.tensor([1, 2, 10, 3, -100, 4])
    with pytest.raises(ValueError, match="label 10 is outside"):
        head.loss(h, target)
    with bd.set_checks(False):
        loss = head.loss(h, target)
        loss.backward()
        per_token = head.loss(h.detach(), target, reduction="none")
    assert torch.isnan(loss) and torch.isnan(head.weight.grad).any() and torch.isnan(h.grad[2]).all()
    assert torch.isnan(per_token[2]) and torch.isfinite(per_token[[0, 1, 3, 4, 5]]).all()


def _head_syncs(tp):
    from bigdense.testing.counters import OpCounter

    if tp > 1:
        bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    out = {}
    for strategy in ("forward", "recompute"):
        head = bd.ParallelClassifierHead(16, 37, chunk_size=4, grad_strategy=strategy)
        h, target = torch.randn(10, 16, requires_grad=True), torch.randint(0, 37, (10,))
        target[3] = -100
        for checks in (True, False):
            with bd.set_checks(checks), OpCounter() as counter:
                head.loss(h, target).backward()
            out[strategy, checks] = counter.syncs
    return out


def test_the_loss_makes_no_host_sync_with_checks_off():
    for counts in run_ranks(_head_syncs, 2, 2):
        assert counts["forward", False] == counts["recompute", False] == 0, counts
        assert counts["forward", True] > 0  # the counter sees the label check's sync
