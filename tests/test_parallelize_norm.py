"""BatchNorm between a column and a row layer: `bd.parallelize` splits it with the features.

Every converted block is compared with an independent unsharded twin: the plain ``nn.Sequential``
copied before `parallelize`, trained the same SGD steps on the same batch. The hidden size is 10,
uneven at tp=3 (4, 3, 3). Outputs, gradients and running statistics agree up to fp32 rounding
of the TP split (each rank's slice of the column product is computed on its own; the row layer's
partial products are all-reduced in another order): atol/rtol 1e-5 on values of order 1, about 100
ulps. The normalisation itself sees exactly the twin's values per feature, so running statistics
carry no extra error beyond that. The DP-synced BatchNorm combines the replicas' statistics with
Chan's formula instead of one pass over the global batch, another fp32 rounding of the same order.
"""
import copy
import inspect

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.layers.base import named_shard_specs
from bigdense.parallel import comm
from bigdense.testing import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)
BN_BIAS_OPTION = "bias" in inspect.signature(nn.BatchNorm1d.__init__).parameters  # torch >= 2.6
VARIANTS = [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}] + (
    [{"bias": False}] if BN_BIAS_OPTION else [])


def _block(hidden=10, **bn):
    """The head block: Linear (bias off) -> BatchNorm1d -> ReLU -> Linear."""
    return nn.Sequential(nn.Linear(6, hidden, bias=False), nn.BatchNorm1d(hidden, **bn), nn.ReLU(),
                         nn.Linear(hidden, 5))


class Affine(nn.Module):
    """A per-feature scale and shift: a module `parallelize` knows nothing of, named in a plan."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.shift = nn.Parameter(torch.linspace(-1.0, 1.0, n))

    def forward(self, x):
        return x * self.scale + self.shift


def _sliced(model, name, full):
    spec = named_shard_specs(model).get(name)
    return full if spec is None else spec.slice_of(full)


def _assert_state_matches(model, plain, where, tol=TOL):
    """Every parameter and buffer of ``model`` (this rank's slice) against the twin's."""
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, _sliced(model, name, plain.state_dict()[name]), **tol,
                                   msg=lambda m: f"{where}: {name}: {m}")


def _sgd_step(model, lr=0.1):
    """Plain SGD by hand (torch.optim's first step imports torch._dynamo: seconds in every rank)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def _train_side_by_side(model, plain, x, target, steps=3, rows=slice(None), scale=1.0, dp_group=None):
    """``steps`` SGD steps of both on ``x`` (the twin on all of it, ``model`` on ``rows``),
    comparing outputs, gradients and state after each. ``dp_group``: the model's gradients are
    summed over it (the twin's loss is the sum over all rows, so is the sum of the replicas')."""
    model.train(), plain.train()
    for step in range(steps):
        out, out_plain = model(x[rows]), plain(x)
        torch.testing.assert_close(out, out_plain[rows], **TOL, msg=lambda m: f"step {step} output: {m}")
        ((out * target[rows]).sum() * scale).backward()
        ((out_plain * target).sum() * scale).backward()
        for name, p in model.named_parameters():
            if dp_group is not None:
                comm.all_reduce_(p.grad, dp_group)
            torch.testing.assert_close(p.grad, _sliced(model, name, dict(plain.named_parameters())[name].grad),
                                       **TOL, msg=lambda m: f"step {step} grad of {name}: {m}")
        _sgd_step(model), _sgd_step(plain)
        _assert_state_matches(model, plain, f"after step {step}")
    model.eval(), plain.eval()
    torch.testing.assert_close(model(x[rows]), plain(x)[rows], **TOL, msg=lambda m: f"eval output: {m}")


# Single-process tests first: their conversions import what the forked ranks would otherwise each import.
def test_norms_that_do_not_act_per_feature_leave_the_pair_whole_with_the_reason():
    model = nn.Module()
    model.bn2d = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm2d(10), nn.Linear(10, 5))
    model.wrong_size = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.BatchNorm1d(7), nn.Linear(10, 5))
    model.layer_norm = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 5))
    model.ok = nn.Sequential(nn.Linear(6, 10), nn.SiLU(), nn.BatchNorm1d(10), nn.Dropout(0.1), nn.Linear(10, 5))
    bd.parallelize(model)
    assert model.bd_parallel_plan == {"ok.0": "column", "ok.2": "per_feature", "ok.4": "row"}
    assert isinstance(model.ok[3], bd.ShardedDropout)  # still on the column layer's shard of the features
    dense = model.bd_parallel_report.dense
    assert "bn2d.1: BatchNorm2d normalises the channels (dim 1)" in dense["bn2d.*"]
    assert "wrong_size.2: BatchNorm1d(num_features=7) does not normalise the 10 features" in dense["wrong_size.*"]
    assert "layer_norm.1: LayerNorm normalises across the features" in dense["layer_norm.*"]
    assert all(type(m) is nn.Linear for m in (model.bn2d[0], model.wrong_size[0], model.layer_norm[0]))


def test_bad_inputs_and_plans_are_refused_naming_the_module():
    with pytest.raises(TypeError, match=r"'1'.*per_feature.*LayerNorm normalises across the features"):
        bd.parallelize(nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 5)),
                       {"0": "column", "1": "per_feature", "2": "row"})
    with pytest.raises(TypeError, match=r"'1'.*per_feature.*buffer"):  # its buffer would stay whole
        odd = Affine(10)
        odd.register_buffer("offset", torch.zeros(10))
        bd.parallelize(nn.Sequential(nn.Linear(6, 10), odd, nn.Linear(10, 5)),
                       {"0": "column", "1": "per_feature", "2": "row"})
    with pytest.raises(ValueError, match=r"Sequential.1 is a Affine, converted in place: options \{'sync_dp': True\}"):
        bd.parallelize(nn.Sequential(nn.Linear(6, 10), Affine(10), nn.Linear(10, 5)),
                       {"0": "column", "1": ("per_feature", {"sync_dp": True}), "2": "row"})
    norm = bd.ShardedBatchNorm1d(10)
    with pytest.raises(ValueError, match=r"ShardedBatchNorm1d\(num_features=10.*input \(N, 10\).*\(2, 3, 10\)"):
        norm(torch.randn(2, 3, 10))  # over (N, C, L) BatchNorm1d would normalise dim 1, which no column layer splits
    with pytest.raises(TypeError, match="expected an nn.BatchNorm1d or nn.SyncBatchNorm, got BatchNorm2d"):
        bd.ShardedBatchNorm1d.from_dense(nn.BatchNorm2d(4))


def _every_variant_at(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    x, target = torch.randn(8, 6) * 2 + 1, torch.randn(8, 5)
    for options in VARIANTS:
        plain = _block(**options)
        model = bd.parallelize(copy.deepcopy(plain))
        assert model.bd_parallel_plan == {"0": "column", "1": "per_feature", "3": "row"}, options
        assert isinstance(model[1], bd.ShardedBatchNorm1d) and isinstance(model[1], nn.BatchNorm1d)
        assert model[1].num_features_local == bd.shard_sizes(10, tp)[ctx.tp_rank]
        _train_side_by_side(model, plain, x, target)
        # Export: a plain nn.BatchNorm1d holding the twin's state, options and mode.
        dense = model[1].to_dense()
        assert type(dense) is nn.BatchNorm1d and repr(dense) == repr(plain[1]) and not dense.training
        for name, value in plain[1].state_dict().items():
            torch.testing.assert_close(dense.state_dict()[name], value, **TOL)
    # A per-feature module of the model's own, named in a plan: converted in place, its parameters split.
    plain = nn.Sequential(nn.Linear(6, 10), Affine(10), nn.GELU(), nn.Linear(10, 5))
    model = bd.parallelize(copy.deepcopy(plain), {"0": "column", "1": "per_feature", "3": "row"})
    assert type(model[1]).__name__ == "Affine" and model[1].scale.shape == (bd.shard_sizes(10, tp)[ctx.tp_rank],)
    _train_side_by_side(model, plain, x, target)
    if tp == 3:  # 2 features over 3 ranks: rank 2 holds none (torch's own batch norm cannot run on none)
        plain = _block(hidden=2)
        model = bd.parallelize(copy.deepcopy(plain))
        assert model[1].num_features_local == [1, 1, 0][ctx.tp_rank]
        _train_side_by_side(model, plain, x, target)
    return tp


@pytest.mark.parametrize("tp", [2, 3])
def test_batchnorm_block_trains_like_the_plain_block(tp):
    """Train and eval mode, gradients, running statistics after 3 steps, every BatchNorm option."""
    assert run_ranks(_every_variant_at, tp, tp, timeout=120) == [tp] * tp


def _synced_over_dp():
    ctx = bd.init_parallel(tp=2, dp=2)
    torch.manual_seed(0)
    x, target = torch.randn(12, 6) * 2 + 1, torch.randn(12, 5)
    rows = [slice(0, 5), slice(5, 12)][ctx.dp_rank]  # uneven replicas: the statistics weigh them by rows
    with pytest.raises(ValueError, match=r"dp_group holds ranks \[.*\] of this rank's TP group"):
        bd.ShardedBatchNorm1d(10, sync_dp=True, dp_group=torch.distributed.group.WORLD)  # the TP peer: other features
    results = []
    for how in ("SyncBatchNorm", "plan option"):
        plain = _block(momentum=None)
        if how == "SyncBatchNorm":
            model = bd.parallelize(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain)))
        else:
            plan = {"0": "column", "1": ("per_feature", {"sync_dp": True}), "3": "row"}
            model = bd.parallelize(copy.deepcopy(plain), plan)
        assert model[1].sync_dp and comm.group_size(model[1].dp_group) == 2
        # The twin sees the global batch in one process; the loss is its mean over all 12 rows.
        _train_side_by_side(model, plain, x, target, rows=rows, scale=1 / 12, dp_group=ctx.dp_group)
        results.append(how)
    return results


def test_synced_batchnorm_over_dp_equals_one_process_on_the_global_batch():
    """tp=2 x dp=2: batch statistics over both replicas' rows, gradients through them, running statistics."""
    for result in run_ranks(_synced_over_dp, 4, timeout=120):
        assert result == ["SyncBatchNorm", "plan option"]


def _save_at_tp2(path):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    plain = _block()
    model = bd.parallelize(copy.deepcopy(plain))
    x, target = torch.randn(8, 6), torch.randn(8, 5)
    _train_side_by_side(model, plain, x, target, steps=2)
    bd.save_checkpoint(path, model, step=2)
    # What was saved, whole: each layer's own export (the reference for bit-exact comparisons).
    return nn.Sequential(model[0].to_dense(), model[1].to_dense(), nn.ReLU(), model[3].to_dense()).state_dict()


def _load_at_tp3(path, reference):
    ctx = bd.init_parallel(tp=3)
    torch.manual_seed(1)  # other weights: the load has to change them
    model = bd.parallelize(_block())
    bd.load_checkpoint(path, model, load_rng=False)
    _assert_state_matches(model, _plain_with(reference), f"tp=3 rank {ctx.tp_rank}", tol=dict(atol=0, rtol=0))
    return model[1].running_var.shape[0]


def _plain_with(state):
    plain = _block()
    plain.load_state_dict(state)
    return plain


def test_checkpoint_reshards_tp2_to_tp3_and_exports_a_plain_batchnorm(tmp_path):
    reference = run_ranks(_save_at_tp2, 2, str(tmp_path / "ckpt" / "step_2"), timeout=120)[0]
    assert run_ranks(_load_at_tp3, 3, str(tmp_path / "ckpt" / "latest"), reference, timeout=120) == [4, 3, 3]
    out = bd.export_dense(tmp_path / "ckpt" / "latest", tmp_path / "block.safetensors")
    plain = _block()
    safetensors.torch.load_model(plain, str(out))  # strict: every name of the plain block, nothing else
    for name, value in plain.state_dict().items():
        assert torch.equal(value, reference[name]), name  # stored and read back bit for bit


def _vgg_head(rows_in, hidden, rows):
    """The VGG BN head block at tp=2, converted in place of the plain one (one copy of the big
    weight per rank): train-mode output and running statistics, then eval-mode output."""
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(rows_in, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(),
                          nn.Linear(hidden, hidden))
    x = torch.randn(rows, rows_in)
    start = copy.deepcopy(plain[1].state_dict())
    with torch.no_grad():
        train_out, stats = plain(x), copy.deepcopy(plain[1].state_dict())
        eval_out = plain.eval()(x)
    plain[1].load_state_dict(start)
    model = bd.parallelize(plain.train())  # converts the twin itself, whose outputs are kept above
    assert model.bd_parallel_plan == {"0": "column", "1": "per_feature", "3": "row"}
    with torch.no_grad():
        torch.testing.assert_close(model(x), train_out, **TOL)
        for name, value in stats.items():
            torch.testing.assert_close(model[1].state_dict()[name], _sliced(model, f"1.{name}", value), **TOL)
        torch.testing.assert_close(model.eval()(x), eval_out, **TOL)
    return ctx.tp_rank


def test_vgg_bn_head_block_small_shapes():
    assert run_ranks(_vgg_head, 2, 50, 12, 4, timeout=120) == [0, 1]


@pytest.mark.slow
def test_vgg_bn_head_block_25088_to_4096():
    """The issue's block at full size: Linear(25088, 4096, bias=False) -> BatchNorm1d(4096) -> ReLU ->
    Linear(4096, 4096); 400 MB of weight per copy, so over 10 s here."""
    assert run_ranks(_vgg_head, 2, 25088, 4096, 4, timeout=300) == [0, 1]
