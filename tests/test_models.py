"""The reference models against an independent plain-PyTorch GPT (`helpers.plain_gpt_loss`, dropout off), and
across TP sizes with dropout on; the attention's manual-dropout path against the fused one.

Dropout masks are TP-invariant, so the only differences between layouts are the summation orders
of the TP all-reduces. Measured: the losses agree exactly and every gradient entry within 5e-7 of
its tensor's largest entry (an absolute scale: small entries are sums with cancellation, where a
relative bound would mean nothing). We allow 1e-6 relative for the loss and 5e-6 of the largest
entry for gradients; a mismatched mask moves the loss by ~1e-2.
"""
import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.config import RecomputeConfig
from bigdense.models import GPT, GPTConfig, ParallelClassifier
from bigdense.testing import RankError, run_ranks

from helpers import assert_close, full_params, plain_gpt_loss

VOCAB = 203  # uneven over 2 and 4 ranks


def _gpt_cfg(**kw):
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.2, head_chunk_size=10)
    return GPTConfig(**{**base, **kw})


VARIANTS = {
    "gelu, tied": {},
    "swiglu, untied, no bias": dict(activation="swiglu", tie_embeddings=False, bias=False, d_hidden=40),
    "invariant attention dropout": dict(attention_dropout=0.3),  # the probabilities' mask, sharded by head
}


def _gpt_run(tp, variant):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(_gpt_cfg(**VARIANTS[variant]), tp_group=ctx.tp_group)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (3, 16), generator=g)
    loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    # Full gradients of a few sharded and replicated parameters, gathered the way to_dense would.
    grads = {
        "tok_emb": bd.parallel.comm.all_gather_dim(model.tok_emb.weight.grad, 0, ctx.tp_group),
        "qkv": bd.parallel.comm.all_gather_dim(model.blocks[0].attn.qkv.weight.grad, 0, ctx.tp_group),
        "out": bd.parallel.comm.all_gather_dim(model.blocks[1].attn.out.weight.grad, 1, ctx.tp_group),
        "ln_f": model.ln_f.weight.grad.clone(),
    }
    return loss.item(), grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpt_loss_and_gradients_match_tp1_with_dropout_on(variant):
    ref_loss, ref_grads = _gpt_run(1, variant)
    torch.manual_seed(0)
    no_dropout = GPT(_gpt_cfg(**VARIANTS[variant], dropout=0.0))
    idx = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    assert abs(no_dropout(idx, idx.roll(-1, dims=1)).item() - ref_loss) > 1e-3  # dropout is really on
    for tp in (2, 4):
        for rank, (loss, grads) in enumerate(run_ranks(_gpt_run, tp, tp, variant)):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (tp, rank, loss, ref_loss)
            for name, g in grads.items():
                assert_close(g, ref_grads[name], f"tp={tp} rank {rank} grad of {name}", rtol=0,
                             atol=5e-6 * ref_grads[name].abs().max().item())


def _against_plain(tp, variant):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(_gpt_cfg(**VARIANTS[variant]), tp_group=ctx.tp_group).eval()
    idx = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = plain_gpt_loss(full_params(model, ctx.tp_group), model.cfg, idx, idx.roll(-1, dims=1),
                               eps=model.ln_f.eps)
        return model(idx, idx.roll(-1, dims=1)).item(), plain.item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpt_matches_an_independent_plain_pytorch_gpt(variant):
    # fp32, the same weights: SDPA vs an explicit softmax, the fused chunked CE vs F.cross_entropy,
    # and (at tp=2) split matmuls summed by all-reduce differ by a few ulps of a loss of ~5.3;
    # 1e-5 relative is ~100 ulps. A wrong head layout, a missing causal mask or a mis-scaled
    # score moves the loss by 1e-2 or more.
    for tp in (1, 2):
        for rank, (ours, plain) in enumerate(run_ranks(_against_plain, tp, tp, variant) if tp > 1
                                             else [_against_plain(1, variant)]):
            assert abs(ours - plain) <= 1e-5 * abs(plain), (variant, tp, rank, ours, plain)


def test_attention_manual_dropout_path_matches_the_fused_path_at_dropout_zero(monkeypatch):
    # The manual path (explicit softmax, then tp_dropout on the probabilities) runs when training
    # with attention dropout > 0 in the "invariant" mode. At p = 1e-12 its masks keep everything and scale by 1/(1 - p), which is 1.0
    # in fp32, so it must equal the fused scaled_dot_product_attention path up to kernel rounding
    # (measured ~1e-7 relative here; 1e-5 allowed).
    torch.manual_seed(0)
    model = GPT(_gpt_cfg(dropout=0.0))
    for blk in model.blocks:
        blk.attn.attention_dropout = 1e-12
    idx = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    fused_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: fused_calls.append(1) or sdpa(*a, **k))
    with torch.no_grad():
        manual = model.train().hidden(idx)
        assert not fused_calls, "training with invariant attention dropout > 0 must take the manual path"
        fused = model.eval().hidden(idx)
        assert len(fused_calls) == len(model.blocks), "evaluation must take the fused path"
    assert_close(manual, fused, "hidden states, manual vs fused attention", rtol=1e-5, atol=1e-5)


def _recompute_grads(tp):
    ctx = bd.init_parallel(tp=tp)
    results = {}
    for mode in ("none", "full", "mlp", "every_k"):
        torch.manual_seed(0)
        model = GPT(_gpt_cfg(), tp_group=ctx.tp_group)
        bd.apply_recompute(model.blocks, RecomputeConfig(mode=mode, every=2))
        idx = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
        model(idx, idx.roll(-1, dims=1)).backward()
        results[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("full", "mlp", "every_k"):
        for a, b in zip(results["none"], results[mode]):
            assert torch.equal(a, b), f"recompute={mode} changed a gradient at tp={tp}"
    return True


def test_gpt_activation_checkpointing_gives_bit_identical_gradients():
    # The recompute replays the same ops on the same inputs with the same dropout seeds: exact.
    assert all(run_ranks(_recompute_grads, 2, 2))


def _heads_not_divisible():
    ctx = bd.init_parallel(tp=3)
    GPT(_gpt_cfg(), tp_group=ctx.tp_group)


def test_tp_that_does_not_divide_the_heads_is_refused_clearly():
    with pytest.raises(RankError, match=r"the TP size=3 must divide n_heads=4"):
        run_ranks(_heads_not_divisible, 3)


def _classifier(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = ParallelClassifier(12, 1001, d_model=16, n_blocks=2, dropout=0.1, head_chunk_size=5,
                               tp_group=ctx.tp_group)
    g = torch.Generator().manual_seed(3)
    x, target = torch.randn(7, 12, generator=g), torch.randint(0, 1001, (7,), generator=g)
    loss = model(x, target)
    loss.backward()
    model.eval()
    scores, classes = model.predict(x, k=3)
    head_grad = bd.parallel.comm.all_gather_dim(model.head.weight.grad, 0, ctx.tp_group)
    return loss.item(), scores, classes, head_grad


def test_classifier_matches_tp1_and_predicts_global_top_k():
    ref_loss, ref_scores, ref_classes, ref_grad = _classifier(1)
    for tp in (2, 3):
        for loss, scores, classes, grad in run_ranks(_classifier, tp, tp):
            assert abs(loss - ref_loss) <= 1e-6 * ref_loss
            assert torch.equal(classes, ref_classes)
            assert_close(scores, ref_scores, "top-k scores", rtol=1e-5, atol=1e-5)
            assert_close(grad, ref_grad, "head weight grad", rtol=0, atol=5e-6 * ref_grad.abs().max().item())
