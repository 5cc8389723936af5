"""Extreme classification with ParallelClassifierHead: margin softmax against InsightFace's formulas,
sampled softmax against the full softmax over the same classes, world sharding against TP-only and
unsharded, layout-independent sampling, bad input. Every reference is written on full logits (helpers.py)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.layers.head.sampling import keep_hash, sampled_class_mask
from bigdense.testing import run_ranks
from head_xc_cases import C, D, batch, margin_case, sampled_case, world_case
from helpers import assert_close


# ---- the sampling hash, written here ----
def murmur_keep(seed, c):
    """keep_hash in plain Python integers (murmur3's fmix32, twice)."""
    def fmix(x):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)
    return fmix(fmix((c & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF)) ^ ((seed >> 32) & 0xFFFFFFFF) ^ (c >> 32))


# ---- margin ----
@pytest.mark.parametrize("margin,tp", [("arcface", 1), ("cosface", 2), ((1.0, 0.3, 0.2), 1), ((1.2, 0.2, 0.0), 2)])
def test_margin_matches_insightface(margin, tp):
    run_ranks(margin_case, tp, margin)


# ---- sampling ----
def test_keep_hash_is_murmur_and_uniform():
    seed = 0x5DEECE66D1234567
    classes = torch.tensor([0, 1, 2, 99, 2**31 - 1, 2**32 + 5])
    assert keep_hash(seed, classes).tolist() == [murmur_keep(seed, int(c)) for c in classes]
    kept = (keep_hash(seed, torch.arange(200_000)) < int(0.1 * 2**32)).float().mean().item()
    # Bernoulli(0.1) over 2e5 classes: sd = sqrt(0.09 / 2e5) = 6.7e-4; allow 5 sd.
    assert abs(kept - 0.1) < 5 * 6.7e-4


def test_sampled_mask_holds_every_target():
    target = torch.tensor([5, 5, 36, -100, 0])
    mask = sampled_class_mask(123, target, 0, C, 1e-9)
    assert mask.nonzero().squeeze(1).tolist() == [0, 5, 36]
    assert sampled_class_mask(123, target, 30, C, 1e-9).nonzero().squeeze(1).tolist() == [6]


def test_sampled_softmax_equals_full_softmax_on_its_classes():
    run_ranks(sampled_case, 1, 1.0, 0.0, "tp", 1)  # r = 1: every class, the plain loss
    counts = run_ranks(sampled_case, 2, 0.3, 0.1, "tp", 2)
    assert 0 < counts[0] < C and counts[0] == counts[1]


@pytest.mark.parametrize("tp,world", [(4, 4), (1, 2), (2, 4)])
def test_sampling_and_world_sharding_at_every_layout(tp, world):
    # The same classes, loss and gradients at tp 1/2/4 x dp 1/2, TP- and world-sharded: each run
    # is checked against the same single-process reference on the global batch.
    for shard in ("tp", "world"):
        if shard == "world" and world == tp:
            continue
        run_ranks(sampled_case, world, 0.3, 0.0, shard, tp)


# ---- world sharding ----
@pytest.mark.parametrize("margin,reduction", [(None, "mean"), ("arcface", "sum"), (None, "none")])
def test_world_sharded_head_equals_tp_head_under_ddp(margin, reduction):
    run_ranks(world_case, 2, margin, reduction)


# ---- bad input ----
def test_bad_options_name_the_option():
    for kwargs, words in (
        (dict(sample_rate=0.0), "sample_rate must be in (0, 1]"),
        (dict(sample_rate=1.5), "sample_rate must be in (0, 1]"),
        (dict(margin="sphereface", bias=False), "margin must be None, one of ['arcface', 'cosface']"),
        (dict(margin=(1.0, 0.5)), "margin must be None"),
        (dict(margin="arcface"), "pass bias=False"),
        (dict(margin="cosface", bias=False, scale=0.0), "scale must be a positive number"),
        (dict(shard="dp"), "shard must be one of ['tp', 'world']"),
    ):
        with pytest.raises(ValueError) as err:
            bd.ParallelClassifierHead(D, C, **{"bias": True, **kwargs})
        assert words in str(err.value) and "ParallelClassifierHead(in_features=8, num_classes=37)" in str(err.value)


def test_world_without_dp_runs_as_tp_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head = bd.ParallelClassifierHead(D, C, shard="world", sample_rate=0.5)
    assert head.shard == "tp" and any("runs as shard='tp'" in str(w.message) for w in caught)
    w, h, target = batch(4)
    with pytest.raises(ValueError, match="label 40 is outside"):
        head.loss(h, torch.where(target == -100, 40, target))


# ---- engines, clipping ----
class _HeadNet(torch.nn.Module):
    """A replicated layer and a big head: ``loss = head(tanh(fc(x)), y)``."""

    def __init__(self, shard, margin=None):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.head = bd.ParallelClassifierHead(D, C, bias=margin is None, shard=shard, margin=margin, sample_rate=0.5)

    def forward(self, x, y):
        return self.head(torch.tanh(self.fc(x)), y)


def _train_both_modes(steps, margin):
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    bd.init_parallel(tp=1)
    ctx = bd.get_default_context()
    out = {}
    for shard in ("tp", "world"):
        torch.manual_seed(0)
        model = _HeadNet(shard, margin)
        engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"),
                                 optim_cfg=OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.05),
                                 precision_cfg=PrecisionConfig(), micro_batch_size=4, grad_accum=2, max_steps=steps)
        ignored = getattr(engine.wrapped, "parameters_to_ignore", set())
        assert ("head.weight" in ignored) == (shard == "world"), ignored
        norms = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            batches = [(torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)) for _ in range(2)]
            torch.manual_seed(100 + step)  # the sampling seed's stream, alike in both modes
            result = engine.train_step([(x[ctx.dp_rank * 4:(ctx.dp_rank + 1) * 4], y[ctx.dp_rank * 4:(ctx.dp_rank + 1) * 4])
                                        for x, y in batches])
            norms.append(result.grad_norm)
        out[shard] = (norms, model.head.to_dense().weight, model.fc.weight.detach().clone(),
                      engine.optimizer.state[model.head.weight]["exp_avg"].clone(), model.head.shard_spec("weight"))
    (n_tp, w_tp, fc_tp, m_tp, spec_tp), (n_w, w_w, fc_w, m_w, spec_w) = out["tp"], out["world"]
    # Clipping bites (norms ~1 against 0.05): a norm counting the world shards twice or on one rank
    # only would scale every update differently and move the weights by far more than this.
    assert_close(torch.tensor(n_w), torch.tensor(n_tp), "grad norms, world vs tp", rtol=1e-5, atol=0)
    # Weights after 4 AdamW steps: Adam divides by sqrt(v), so an update is ~lr whatever the gradient's
    # size, and a last-bit difference in a tiny gradient (summed over DP by a reduce-scatter in one
    # mode, averaged by DDP in the other) moves a weight by a few 1e-7 of lr: measured up to 2e-5
    # relative on single entries. A wrong DP average or a shard counted twice moves them by percents.
    assert_close(w_w, w_tp, "head weight after training, world vs tp", rtol=1e-4, atol=1e-5)
    assert_close(fc_w, fc_tp, "replicated layer after training, world vs tp", rtol=1e-4, atol=1e-5)
    assert m_w.shape == spec_w.local_shape and spec_w.group == "world"


@pytest.mark.parametrize("margin", [None, "cosface"])
def test_ddp_training_reaches_the_same_weights_world_or_tp(margin):
    run_ranks(_train_both_modes, 2, 4, margin)


# ---- checkpoints ----
def _save_world(path):
    """tp=2 x dp=2, the head world-sharded (37 classes over 4 ranks: 10, 9, 9, 9): two AdamW steps."""
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = _HeadNet("world", margin="arcface")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx = bd.get_default_context()
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)
        model(x[ctx.dp_rank * 4:(ctx.dp_rank + 1) * 4], y[ctx.dp_rank * 4:(ctx.dp_rank + 1) * 4]).backward()
        for p in model.fc.parameters():  # what DDP does for the replicated layer
            torch.distributed.all_reduce(p.grad, group=ctx.dp_group)
            p.grad /= ctx.dp_size
        opt.step()
        opt.zero_grad()
    bd.save_checkpoint(path, model, opt, step=2)
    spec = model.head.shard_spec("weight")
    assert spec.group == "world" and spec.sizes == (10, 9, 9, 9)
    return model.head.to_dense().weight, _full_moment(model, opt, spec)


def _full_moment(model, opt, spec):
    from bigdense.parallel import comm

    # (the head's group is the one its classes are split over: the world, or the TP group)
    return comm.all_gather_dim(opt.state[model.head.weight]["exp_avg"], 0, model.head.tp_group, spec.sizes).clone()


def _load(path, shard, tp):
    bd.init_parallel(tp=tp)
    torch.manual_seed(123)  # other values, so a load that does nothing fails
    model = _HeadNet(shard, margin="arcface")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bd.load_checkpoint(path, model, opt)
    return model.head.to_dense().weight, _full_moment(model, opt, model.head.shard_spec("weight"))


@pytest.mark.slow  # four ranks on two cores: ~30 s
def test_world_sharded_checkpoint_reshards_to_tp_and_unsharded(tmp_path):
    weight, moment = run_ranks(_save_world, 4, tmp_path / "w")[0]
    for w, m in run_ranks(_load, 2, tmp_path / "w", "tp", 2):  # TP-sharded at 2
        assert torch.equal(w, weight) and torch.equal(m, moment)
    w, m = _load(tmp_path / "w", "tp", 1)  # one process, unsharded
    assert torch.equal(w, weight) and torch.equal(m, moment)


# ---- the GPU-shaped fused loss: buffers, chunk sizes, overlap (counted on CPU) ----
class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every new storage an op creates (bytes) and the op sequence."""

    def __init__(self):
        super().__init__()
        self.seen, self.sizes, self.ops = set(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func.overloadpacket), tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def _big_allocations(chunks, dtype):
    # Many classes, a narrow width: a chunk's bf16 logits (4 KB) outweigh any per-token tensor (at
    # most 16 chunks x 4 tokens x 8 wide x 4 bytes = 2 KB) and any per-class vector (2 KB), so only
    # chunk-sized and weight-sized (16 KB) buffers reach it.
    classes, width, chunk = 512, 8, 4
    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(width, classes, chunk_size=chunk)
    h = torch.randn(chunks * chunk, width, requires_grad=True)
    target = torch.randint(0, classes, (chunks * chunk,))
    with _Allocations() as seen, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        head.loss(h, target).backward()
    weight_sized = sum(1 for b in seen.sizes if b >= classes * width * 2)
    logits_sized = sum(1 for b in seen.sizes if b > classes * 4)
    return weight_sized, logits_sized


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_loss_allocates_nothing_per_chunk(dtype):
    # Buffers of a chunk's logits or the weight's size are made once per call, however many chunks:
    # doubling the chunks must not add one (a per-chunk bf16 logits tensor, its fp32 copy or a
    # weight-sized product for the fp32 gradient each would add one per chunk).
    assert _big_allocations(8, dtype) == _big_allocations(16, dtype)


def test_logits_far_below_the_maximum_match_cross_entropy():
    """Shifted logits below -87 are raised to exp(-87) = 1.6e-38 (off the CPU's slow exp path): with
    logits spread over +-300, the loss and gradients still equal F.cross_entropy's. Tolerance: a
    logit of 300 carries an fp32 rounding of ~2e-5, which moves its softmax by that relative amount
    whatever the order of summation (the code before the floor differed from F.cross_entropy by 2.5e-5
    on gradients of size 8 here); the raised terms are below every sum's resolution."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(8, 50, bias=True)
    with torch.no_grad():
        dense.weight.mul_(100.0)
    head = bd.ParallelClassifierHead.from_dense(dense, chunk_size=3)
    h, target = torch.randn(7, 8), torch.randint(0, 50, (7,))
    assert (dense(h).amax(1, keepdim=True) - dense(h)).amax() > 200  # many terms under the floor
    for eps in (0.0, 0.1):
        x, xr = h.clone().requires_grad_(), h.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        loss = head.loss(x, target, label_smoothing=eps)
        ref = F.cross_entropy(dense(xr), target, label_smoothing=eps)
        loss.backward()
        ref.backward()
        for what, ours, theirs in (("loss", loss, ref), ("grad h", x.grad, xr.grad),
                                   ("grad W", head.weight.grad, dense.weight.grad),
                                   ("grad b", head.bias.grad, dense.bias.grad)):
            assert_close(ours, theirs, f"eps={eps} {what}", rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


def test_chunk_sizes_per_device():
    from bigdense.layers.head.ce_chunks import auto_chunk_size

    # CPU: one 128 MiB slot, a multiple of 16 tokens, at least 64 (thinner chunks slow the GEMMs down).
    assert auto_chunk_size(125_000, "cpu") == 256  # 268 tokens fit, rounded down to a multiple of 16
    assert auto_chunk_size(500_000, "cpu") == 64  # 67 fit
    assert auto_chunk_size(2_000_000, "cpu") == 64  # 16 fit: 512 MiB rather than thin GEMMs
    for classes in (1000, 125_000, 10_000_000):
        tokens = auto_chunk_size(classes, "cuda")
        assert tokens % 128 == 0 and tokens >= 128 and (tokens == 128 or tokens * classes * 4 <= 512 * 2**20)


def _overlap_order(slots):
    import bigdense.layers.head.ce_chunks as ce_chunks

    bd.init_parallel(tp=2)
    if slots == 2:  # as on GPUs (the rank process ends after)
        ce_chunks.logits_slots = lambda group_size, device_type: 2
    classes, width, chunk, chunks = 64, 16, 4, 3
    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(width, classes, chunk_size=chunk)
    h, target = torch.randn(chunks * chunk, width, requires_grad=True), torch.randint(0, classes, (chunks * chunk,))
    with _Allocations() as seen:
        head.loss(h, target)
    logits = [i for i, (op, shape) in enumerate(seen.ops) if op in ("aten.mm", "aten.addmm") and shape == (32, chunk)]
    gathers = [i for i, (op, _) in enumerate(seen.ops) if "allgather" in op]
    # Combining a chunk's gathered statistics rescales each rank's sum: the one exp of (ranks, chunk).
    combined = [i for i, (op, shape) in enumerate(seen.ops) if op == "aten.exp" and shape == (2, chunk)]
    assert len(logits) == len(gathers) == len(combined) == chunks, (logits, gathers, combined)
    for k in range(chunks - 1):
        if slots == 2:  # chunk k's statistics are gathered before chunk k+1's matmul and used only after it
            assert gathers[k] < logits[k + 1] < combined[k]
        else:  # one slot: chunk k is finished before chunk k+1's logits overwrite it
            assert gathers[k] < combined[k] < logits[k + 1]


@pytest.mark.parametrize("slots", [1, 2], ids=["cpu-one-slot", "gpu-two-slots"])
def test_statistics_all_gather_overlaps_the_next_chunks_matmul_only_with_two_slots(slots):
    run_ranks(_overlap_order, 2, slots)


def test_unit_rows_matches_f_normalize_with_zero_and_tiny_rows():
    # The margin heads normalise with UnitRows' hand-written backward; autograd through F.normalize
    # is the twin. float64, so the two orders of summation agree to ~1e-16 relative. A zero row (a
    # sample's padding) and a row of norm below eps take F.normalize's clamped branch (gradient over
    # eps, no projection), which a backward that always projects gets wrong by the projected term.
    from bigdense.layers.head.margin import unit_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64)
    x[2], x[4], x[6] = 0.0, x[4] * 1e-14, x[6] * 1e6
    grad = torch.randn(9, 6, generator=g, dtype=torch.float64)
    ours, twin = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = unit_rows(ours), F.normalize(twin, dim=-1)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(ours.grad, twin.grad, rtol=1e-13, atol=0)
    assert ours.grad[4].abs().max() > 1e10  # the clamped branch ran: gradient over eps = 1e-12
