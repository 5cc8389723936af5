"""ParallelSelfAttention against an attention written out by hand on the unsharded weights."""
import math

import pytest
import torch

import bigdense as bd
from bigdense.models.gpt import ParallelSelfAttention
from bigdense.testing import run_ranks

from helpers import assert_close

D, HEADS, B, S = 24, 4, 2, 7
# fp32: SDPA and the hand-written attention differ in summation order (fused kernels, TP sums of
# the output projection): a few ulps of O(1) values.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _reference(x, qkv_w, qkv_b, out_w, out_b):
    """Causal multi-head attention, heads laid out [head: q, k, v] in the qkv rows."""
    b, s, _ = x.shape
    q, k, v = (x @ qkv_w.t() + qkv_b).view(b, s, HEADS, 3, D // HEADS).permute(3, 0, 2, 1, 4)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, D)
    return y @ out_w.t() + out_b


def _attention_matches(tp, **kw):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    attn = ParallelSelfAttention(D, HEADS, tp_group=ctx.tp_group, **kw)
    x = torch.randn(B, S, D, requires_grad=True)
    y = attn(x)
    y.square().sum().backward()
    qkv, out = attn.qkv.to_dense(), attn.out.to_dense()
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference(x_ref, qkv.weight, qkv.bias, out.weight, out.bias)
    ref.square().sum().backward()
    assert_close(y, ref, f"tp={tp} {kw} output", **FP32)
    assert_close(x.grad, x_ref.grad, f"tp={tp} {kw} input grad", **FP32)
    return True


@pytest.mark.parametrize("kw", [{}, {"attention_dropout": 0.2, "attention_dropout_mode": "fused"}])
@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_matches_a_hand_written_attention(tp, kw):
    """Without probability dropout (or in eval, for the fused mode), SDPA is the path taken."""
    def run(tp):
        attn_kw = dict(kw)
        ok = _attention_matches(tp, **attn_kw) if not attn_kw else _eval_matches(tp, attn_kw)
        return ok
    assert all(run_ranks(run, tp, tp)) if tp > 1 else run(1)


def _eval_matches(tp, kw):
    # In eval, dropout of any mode is off: compare the same module's eval output with the reference.
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    attn = ParallelSelfAttention(D, HEADS, tp_group=ctx.tp_group, **kw).eval()
    x = torch.randn(B, S, D)
    qkv, out = attn.qkv.to_dense(), attn.out.to_dense()
    assert_close(attn(x), _reference(x, qkv.weight, qkv.bias, out.weight, out.bias), f"eval {kw}", **FP32)
    return True


def test_probability_dropout_modes_are_on_in_training_and_bad_modes_are_named():
    torch.manual_seed(0)
    x = torch.randn(B, S, D)
    for mode in ("invariant", "fused"):
        attn = ParallelSelfAttention(D, HEADS, attention_dropout=0.5, attention_dropout_mode=mode)
        assert not torch.allclose(attn(x), attn.eval()(x)), mode
    with pytest.raises(ValueError, match="attention_dropout_mode must be one of"):
        ParallelSelfAttention(D, HEADS, attention_dropout=0.1, attention_dropout_mode="exact")
