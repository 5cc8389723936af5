"""bd.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the unsharded (tp=1) twin, at tp = 2, 3, 4.

The twin is the same model class built with no TP group after the same seed; bigdense's
initialisation does not depend on the TP size, so both hold the same weights, and both get
gradients from the same loss on the same input.

Tolerance: rtol 1e-5, atol 1e-7 on norms and clipped gradients. The sharded gradients equal the
twin's up to a few ulps (matmuls blocked differently, partial sums added over ranks), and the norm
adds the per-parameter terms in another order and over ranks; with ~10 parameters of unit-scale
gradients that moves the fp32 result by ~1e-7 relative. A replicated parameter counted tp times
instead of once, or a missing shard, moves the norm by tens of percent. Gradients get atol 1e-6:
the vocab-parallel cross-entropy of the tied model combines per-rank maxima and sums of
exponentials, which leaves ~2e-7 absolute differences on O(1e-2) entries near zero.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.testing import run_ranks

from helpers import assert_close, shard_specs

TOL = dict(rtol=1e-5, atol=1e-7)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
D, H, V = 12, 22, 19  # 22 and 19 split unevenly over 3 and 4 ranks


class Net(nn.Module):
    """Column -> GELU -> Row(bias: TP-replicated) -> LayerNorm (replicated), twice, where the
    second block's up-projection is tied to the first's (one sharded Parameter used twice)."""

    def __init__(self):
        super().__init__()
        self.up1 = bd.ColumnParallelLinear(D, H)
        self.down1 = bd.RowParallelLinear(H, D)
        self.ln = nn.LayerNorm(D)
        self.up2 = bd.ColumnParallelLinear(D, H)
        self.up2.weight = self.up1.weight
        self.down2 = bd.RowParallelLinear(H, D, bias=False)

    def forward(self, x, y):
        h = self.ln(x + self.down1(F.gelu(self.up1(x))))
        h = h + self.down2(F.gelu(self.up2(h)))
        return F.mse_loss(h, y)


class TiedLM(nn.Module):
    """Vocab-parallel embedding tied to a vocab-parallel head (with a sharded bias)."""

    def __init__(self):
        super().__init__()
        self.emb = bd.VocabParallelEmbedding(V, D)
        self.mix = bd.ColumnParallelLinear(D, H)
        self.back = bd.RowParallelLinear(H, D)
        self.head = bd.tie_weights(self.emb, bd.ParallelClassifierHead(D, V))

    def forward(self, ids, target):
        h = self.emb(ids)
        h = h + self.back(torch.tanh(self.mix(h)))
        return self.head.loss(h, target)


def _inputs(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "tied":
        return torch.randint(0, V, (3, 5), generator=g), torch.randint(0, V, (3, 5), generator=g)
    return torch.randn(4, 3, D, generator=g), torch.randn(4, 3, D, generator=g)


def _build(kind, seed):
    torch.manual_seed(seed)
    return TiedLM() if kind == "tied" else Net()


def _compare_with_twin(tp, rank):
    """At this rank: every case, sharded model vs the twin, norms and clipped gradients."""
    cases = [(kind, norm_type, max_norm) for kind in ("net", "tied")
             for norm_type in (2.0, math.inf, 1.5) for max_norm in (1e-3, 1e3)]
    checked = 0
    for i, (kind, norm_type, max_norm) in enumerate(cases):
        what = f"{kind}, norm_type={norm_type}, max_norm={max_norm}, tp={tp}, rank={rank}"
        ctx = bd.get_default_context()
        bd.set_default_context(None)  # the twin: no TP group at all
        twin = _build(kind, 100 + i)
        bd.set_default_context(ctx)
        model = _build(kind, 100 + i)
        x, y = _inputs(kind, 200 + i)
        twin(x, y).backward()
        model(x, y).backward()

        # A plain parameter list with the tied weight listed twice must count it once too.
        params = list(model.parameters()) + [p for p in model.parameters() if p.dim() == 2][:1]
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type)
        total = bd.clip_grad_norm_(params, max_norm, norm_type)
        assert total.dtype == torch.float32 and total.dim() == 0, what
        assert_close(total, expected, f"{what}: norm", **TOL)

        twin_params = dict(twin.named_parameters())
        specs = shard_specs(model)
        for name, p in model.named_parameters():
            full = twin_params[name].grad
            want = specs[name].slice_of(full) if name in specs else full
            assert_close(p.grad, want, f"{what}: clipped grad of {name}", **GRAD_TOL)
        checked += 1
    return checked


def _nonfinite_on_one_rank(tp, rank):
    """An inf or nan on one TP rank only: every rank sees a non-finite norm and keeps its grads."""
    results = []
    cases = (("replicated", math.nan), ("replicated", math.inf), ("sharded", math.inf), ("sharded", math.nan))
    for where, bad in cases:
        for norm_type in (2.0, math.inf):
            torch.manual_seed(7)
            model = Net()
            model(*_inputs("net", 8)).backward()
            target = model.down1.bias if where == "replicated" else model.up1.weight
            if rank == tp - 1:
                target.grad.view(-1)[0] = bad
            before = [p.grad.clone() for p in model.parameters()]
            total = bd.clip_grad_norm_(model, 1e-3, norm_type)
            assert not math.isfinite(total.item()), f"{where} {bad} at norm_type={norm_type}: norm {total.item()}"
            for b, p in zip(before, model.parameters()):
                assert torch.equal(b.nan_to_num(), p.grad.nan_to_num()), f"{where} {bad}: grads were clipped"
            with pytest.raises(RuntimeError, match="non-finite"):
                bd.clip_grad_norm_(model, 1e-3, norm_type, error_if_nonfinite=True)
            results.append(total.item())
    return results


def _rank_main(tp):
    ctx = bd.init_parallel(tp=tp)
    return _compare_with_twin(tp, ctx.tp_rank), _nonfinite_on_one_rank(tp, ctx.tp_rank)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_clip_matches_unsharded_twin(tp):
    results = run_ranks(_rank_main, tp, tp, timeout=240)
    assert all(checked == 12 for checked, _ in results)
    # Every rank agreed on the non-finite norms (same kind of value on every rank).
    for nonfinite in zip(*(r[1] for r in results)):
        assert len({("nan" if v != v else v) for v in nonfinite}) == 1, nonfinite


def test_single_process_matches_torch():
    torch.manual_seed(0)
    model = Net()  # no context: unsharded
    x, y = _inputs("net", 1)
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        for max_norm in (1e-2, 1e3, 0.0):
            model.zero_grad()
            model(x, y).backward()
            twin_grads = [p.grad.clone() for p in model.parameters()]
            twin = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
            for t, g in zip(twin, twin_grads):
                t.grad = g
            expected = torch.nn.utils.get_total_norm(twin_grads, norm_type)
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(twin, max_norm, norm_type)
            # max_norm=0: measure only, with grad_norm (clip_grad_norm_ refuses a max_norm <= 0).
            total = bd.clip_grad_norm_(model, max_norm, norm_type) if max_norm > 0 else bd.grad_norm(model, norm_type)
            what = f"norm_type={norm_type}, max_norm={max_norm}"
            assert_close(total, expected, f"{what}: norm", **TOL)
            for t, p in zip(twin, model.parameters()):
                # grad_norm only measures: gradients untouched.
                assert_close(p.grad, t.grad, f"{what}: grad", **TOL)


def test_bf16_grads_accumulate_in_fp32():
    # 4096 equal bf16 entries: summing their squares in bf16 would stall far below the true
    # value (bf16 keeps 8 bits of mantissa); the fp32 accumulation is exact here.
    p = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    p.grad = torch.full((4096,), 0.5, dtype=torch.bfloat16)
    total = bd.grad_norm([p])
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(0.5 * 64.0, rel=1e-6)


def test_no_grads_and_bad_norm_type():
    p = nn.Parameter(torch.ones(3))
    assert bd.clip_grad_norm_([p], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="norm_type"):
        bd.clip_grad_norm_([p], 1.0, norm_type=0)
