"""The extreme-classification head's cases against the full-logits reference of helpers.py (margins as
InsightFace writes them, a sampled softmax as the full softmax over the sampled classes, a world-sharded
head as the TP-sharded one under DDP), shared by two test files: tests/test_head_xc.py runs them on the
head's CPU loop, tests/test_head_kernels.py on its GPU loop (the Triton kernels, interpreted on CPU).
The rank functions are module-level so that run_ranks can start them in its ranks."""
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.layers.head.sampling import sampled_class_mask
from bigdense.parallel.random import draw_seed
from helpers import assert_close, head_reference

D, C, N = 8, 37, 12  # 37 classes: uneven over 2, 3 and 4 ranks
# fp32, softmax-scaled cosines (scale up to 64): logits reach |64|, and the sharded loss sums in a
# different order (per-rank partial sums, chunked grad_W) -- a few ulps of values of that size.
FP32 = dict(rtol=1e-5, atol=1e-5)
# Margin heads at scale 64: two fp32 computations of a cosine differ by an ulp (6e-8) and the logit
# by 64 times that; the softmax (and the gradient) sees differences of logits of size ~100 summed
# in a different order over shards and chunks: measured up to 7e-5 relative on single gradient
# entries, so one decade above fp32's bound.
MARGIN = dict(rtol=1e-4, atol=1e-4)


def batch(seed, n=N, c=C, ignore=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(c, D, generator=g)
    h = torch.randn(n, D, generator=g)
    target = torch.randint(0, c, (n,), generator=g)
    if ignore:
        target[3] = -100
    return w, h, target


# ---- margin ----
def margin_case(margin):
    bd.init_parallel(tp=torch.distributed.get_world_size())
    w, h, target = batch(1)
    # Tokens pointing away from their class (theta near pi) exercise ArcFace's theta + m > pi branch.
    h[0], h[5] = -w[target[0]] + 0.03, -w[target[5]] + 0.1  # (not exactly -w: acos is not differentiable at -1)
    m = bd.layers.head.margin.MARGINS[margin] if isinstance(margin, str) else margin
    for strategy in ("forward", "recompute"):
        head = bd.ParallelClassifierHead(D, C, bias=False, margin=margin, chunk_size=5, grad_strategy=strategy)
        with torch.no_grad():
            head.weight.copy_(head.shard_spec("weight").slice_of(w))
        hh = h.clone().requires_grad_()
        loss = head.loss(hh, target)
        loss.backward()
        ref = head_reference(w, h, target, margin=m)
        what = f"margin={margin} {strategy}"
        assert_close(loss, ref[0], f"{what} loss", **MARGIN)
        assert_close(hh.grad, ref[1], f"{what} grad h", **MARGIN)
        assert_close(head.weight.grad, head.shard_spec("weight").slice_of(ref[2]), f"{what} grad W", **MARGIN)
    scores, ids = head.predict(h, k=3)
    cos = F.normalize(h) @ F.normalize(w).t()
    assert torch.equal(ids, cos.topk(3).indices), "a margin head's predict ranks by cosine"
    assert_close(scores, 64.0 * cos.topk(3).values, "predict scores are scale * cos", **MARGIN)


# ---- sampling ----
def sampled_case(rate, eps, shard, tp):
    world = torch.distributed.get_world_size()
    bd.init_parallel(tp=tp)
    ctx = bd.get_default_context()
    w, h, target = batch(2, n=N * ctx.dp_size)
    rows = slice(ctx.dp_rank * N, (ctx.dp_rank + 1) * N)
    bias = torch.randn(C, generator=torch.Generator().manual_seed(9))
    for strategy in ("forward", "recompute"):
        torch.manual_seed(77)
        head = bd.ParallelClassifierHead(D, C, shard=shard, sample_rate=rate, chunk_size=5, grad_strategy=strategy)
        with torch.no_grad():
            head.weight.copy_(head.shard_spec("weight").slice_of(w))
            head.bias.copy_(head.shard_spec("bias").slice_of(bias))
        torch.manual_seed(1000)
        hh = h[rows].clone().requires_grad_()
        loss = head.loss(hh, target[rows], label_smoothing=eps)
        loss.backward()
        # The reference draws the seed the head draws, from the same generator state.
        torch.manual_seed(1000)
        classes = sampled_class_mask(draw_seed(), target, 0, C, rate).nonzero().squeeze(1)
        ref = head_reference(w, h[rows], target[rows], classes=classes, eps=eps, bias=bias)
        # Weight grads: DDP would average the DP ranks' gradients of their own losses.
        ref_w = torch.stack([head_reference(w, h[d * N:(d + 1) * N], target[d * N:(d + 1) * N], classes=classes,
                                       eps=eps, bias=bias)[2] for d in range(ctx.dp_size)]).mean(0)
        what = f"rate={rate} eps={eps} shard={shard} tp={tp} world={world} {strategy}"
        assert_close(loss, ref[0], f"{what} loss", **FP32)
        assert_close(hh.grad, ref[1], f"{what} grad h", **FP32)
        grad_w = head.weight.grad
        if head.shard == "tp" and ctx.dp_size > 1:
            torch.distributed.all_reduce(grad_w, group=ctx.dp_group)
            grad_w /= ctx.dp_size
        assert_close(grad_w, head.shard_spec("weight").slice_of(ref_w), f"{what} grad W", **FP32)
        unsampled = torch.ones(C, dtype=torch.bool)
        unsampled[classes] = False
        assert not head.shard_spec("weight").slice_of(ref_w)[head.shard_spec("weight").slice_of(unsampled)].any()
    return len(classes)


# ---- world sharding ----
def world_case(margin, reduction):
    bd.init_parallel(tp=1)
    ctx = bd.get_default_context()
    w, h, target = batch(3, n=N * ctx.dp_size)
    rows = slice(ctx.dp_rank * N, (ctx.dp_rank + 1) * N)
    grads = {}
    for shard in ("tp", "world"):
        head = bd.ParallelClassifierHead(D, C, bias=False, shard=shard, margin=margin, chunk_size=5)
        with torch.no_grad():
            head.weight.copy_(head.shard_spec("weight").slice_of(w))
        hh = h[rows].clone().requires_grad_()
        loss = head.loss(hh, target[rows], reduction=reduction)
        (loss * torch.arange(loss.numel()).view(loss.shape) if reduction == "none" else loss).sum().backward()
        grad_w = head.weight.grad
        if shard == "tp":  # DDP's average
            torch.distributed.all_reduce(grad_w, group=ctx.dp_group)
            grad_w /= ctx.dp_size
        grads[shard] = (loss.detach(), hh.grad, grad_w, head.shard_spec("weight"))
    (l_tp, gh_tp, gw_tp, spec_tp), (l_w, gh_w, gw_w, spec_w) = grads["tp"], grads["world"]
    assert spec_w.group == "world" and len(spec_w.sizes) == ctx.world_size and spec_tp.group == "tp"
    tol = FP32 if margin is None else MARGIN
    assert_close(l_w, l_tp, "world loss vs tp", **tol)
    assert_close(gh_w, gh_tp, "world grad h vs tp", **tol)
    # tp=1: the TP-sharded head holds every class, so its DDP-averaged gradient is the full one.
    assert_close(gw_w, spec_w.slice_of(gw_tp), "world grad W vs DDP-averaged tp", **tol)
