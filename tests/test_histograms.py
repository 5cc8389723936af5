"""Dense-layer histograms describe the unsharded tensors: at tp=1 and tp=2 (and under FSDP) they
equal an independent histogram of the whole tensor, taken here with ``torch.histogram`` (its own
binary search) against the documented edges, the whole tensor assembled in the test from every
rank's shard. bigdense initialises its layers layout-independently, so the same seed gives the same
global weights at every TP size: weight histograms must be identical at tp=1 and tp=2. Gradients
of a real backward differ across layouts by rounding, so each layout's gradient histograms are
checked against that layout's own assembled gradient; set gradients (the same global tensor
sliced per rank) check the gradient path across layouts exactly.

What is exact and what is not: the minimum, maximum, edges and counts are exact (an element's bin
depends on its value and the edges only); the sum and sum of squares are float64 sums of float32
values regrouped over ranks, so they agree to n * 2**-53 * sum|x| (n <= 10**5: about 1e-11 of
sum|x|), checked at 1e-9; a shard missed or counted twice moves them by a whole shard's share.
"""
import os

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.models import GPT, GPTConfig
from bigdense.parallel.sharding import shard_spec_of
from bigdense.testing import run_ranks
from bigdense.train.histograms import BINS, DenseLayerHistograms, bin_edges
from bigdense.train.metrics import MetricsLog, weighted_dense_layers


def _layers(tp_group):
    """Column, row and SwiGLU MLP layers with uneven shards at tp=2, and a plain replicated nn.Linear."""
    return nn.ModuleDict({
        "col": bd.ColumnParallelLinear(11, 13, tp_group=tp_group),
        "row": bd.RowParallelLinear(13, 9, tp_group=tp_group),
        "mlp": bd.ParallelMLP(12, 7, "swiglu", tp_group=tp_group),
        "plain": nn.Linear(5, 6),
    })


def _gpt(tp_group):
    # A fused [q; k; v] projection (packed shards), a vocabulary-parallel embedding and head.
    return GPT(GPTConfig(vocab_size=101, d_model=32, n_layers=1, n_heads=2, max_seq_len=8, dropout=0.0),
               tp_group=tp_group)


def _shards(model):
    """``{layer: (local weight, local grad, spec)}``: what the test assembles the whole tensors from."""
    return {name: (m.weight.detach().clone(), m.weight.grad.clone(), shard_spec_of(m.weight))
            for name, m in weighted_dense_layers(model).items()}


def _set_grads(model):
    """Every weight's gradient: this rank's slice of a global tensor drawn from a fixed seed."""
    for i, (name, m) in enumerate(sorted(weighted_dense_layers(model).items())):
        spec = shard_spec_of(m.weight)
        shape = spec.global_shape if spec is not None else m.weight.shape
        full = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i)) * (i + 1)
        m.weight.grad = spec.slice_of(full).clone() if spec is not None else full


def _run(tp):
    """At ``tp``: the layers' histograms with set gradients, the GPT's with a real backward, the
    GPT's shards, and how many collectives one collect() issued."""
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    layers = _layers(ctx.tp_group)
    _set_grads(layers)
    with bd.count_collectives() as counts:
        layer_hists = DenseLayerHistograms(layers, ctx.tp_group).collect()
    torch.manual_seed(0)
    gpt = _gpt(ctx.tp_group)
    idx = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    gpt(idx, idx).backward()
    return layer_hists, DenseLayerHistograms(gpt, ctx.tp_group).collect(), _shards(gpt), counts.calls("all_reduce")


@pytest.fixture(scope="module")
def runs():
    return {1: [_run(1)], 2: run_ranks(_run, 2, 2)}


def _assemble(shards_per_rank):
    """``{"hist/<layer>/weight|grad": whole tensor}`` from every rank's shards."""
    full = {}
    for name, (weight, grad, spec) in shards_per_rank[0].items():
        for kind, i in (("weight", 0), ("grad", 1)):
            pieces = [shards[name][i] for shards in shards_per_rank]
            full[f"hist/{name}/{kind}"] = spec.assemble(pieces) if spec is not None else pieces[0]
    return full


def _assert_is_histogram_of(h, full, tag):
    x = full.detach().float().reshape(-1)
    lo, hi = x.min(), x.max()
    edges = bin_edges(lo, hi, BINS)
    counts = torch.histogram(x, bins=edges).hist
    assert (h.min, h.max, h.num) == (lo.item(), hi.item(), x.numel()), tag
    assert h.bucket_limits == edges.tolist(), tag
    assert h.bucket_counts == [0.0] + counts.tolist(), tag
    scale = x.double().abs().sum().item()
    assert abs(h.sum - x.double().sum().item()) <= 1e-9 * scale, tag
    assert abs(h.sum_squares - x.double().square().sum().item()) <= 1e-9 * x.double().square().sum().item(), tag


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for tag in a:
        x, y = a[tag], b[tag]
        assert (x.min, x.max, x.num, x.bucket_limits, x.bucket_counts) == \
               (y.min, y.max, y.num, y.bucket_limits, y.bucket_counts), (what, tag)
        assert abs(x.sum - y.sum) <= 1e-9 * max(abs(y.sum), y.sum_squares ** 0.5), (what, tag)
        assert abs(x.sum_squares - y.sum_squares) <= 1e-9 * y.sum_squares, (what, tag)


def test_bin_edges_are_even_steps_over_the_range_ending_exactly_at_its_ends():
    lo, hi = torch.tensor([-1.3, 2.0, 5.0]), torch.tensor([0.7, 2.0, 1e6])
    edges = bin_edges(lo, hi, 64)
    assert edges.shape == (3, 65) and edges.dtype == torch.float32
    assert torch.equal(edges[:, 0], torch.tensor([-1.3, 1.5, 5.0])) and torch.equal(edges[:, -1], torch.tensor([0.7, 2.5, 1e6]))
    # A constant tensor gets [value - 0.5, value + 0.5], as numpy.histogram does; edges never decrease.
    assert (edges.diff(dim=1) >= 0).all()
    # Each edge is float64 lo + (hi - lo) * i / 64 rounded once: within half an fp32 ulp of torch.linspace's.
    for row, (a, b) in enumerate([(-1.3, 0.7), (1.5, 2.5), (5.0, 1e6)]):
        a, b = torch.tensor(a).item(), torch.tensor(b).item()  # the fp32 ends, as float64
        exact = torch.linspace(a, b, 65, dtype=torch.float64)
        assert ((edges[row].double() - exact).abs() <= exact.abs() * 2.0**-24 + 1e-30).all(), row


def test_layer_histograms_are_those_of_the_whole_tensors_at_tp1_and_tp2(runs):
    reference, _, _, _ = runs[1][0]
    # Column, row, both MLP projections and the down projection, the replicated Linear: weight and grad.
    assert len(reference) == 2 * 6
    torch.manual_seed(0)  # the same seed: the same global weights, built whole in this process
    layers_twin = _layers(None)
    _set_grads(layers_twin)
    for name, m in weighted_dense_layers(layers_twin).items():
        _assert_is_histogram_of(reference[f"hist/{name}/weight"], m.weight, name)
        _assert_is_histogram_of(reference[f"hist/{name}/grad"], m.weight.grad, name)
    for rank, (hists, _, _, calls) in enumerate(runs[2]):
        _assert_same(hists, reference, f"tp=2 rank {rank}")
        # One MIN all-reduce of the ranges and one SUM of the counts, however many layers.
        assert calls == 2, calls


def test_gpt_histograms_are_those_of_the_whole_tensors_and_weights_agree_across_tp(runs):
    _, reference, shards, _ = runs[1][0]
    full = _assemble([shards])
    assert reference.keys() == full.keys() and "hist/blocks.0.attn.qkv/weight" in reference
    for tag, h in reference.items():
        _assert_is_histogram_of(h, full[tag], tag)
    per_rank = [gpt for _, gpt, _, _ in runs[2]]
    full = _assemble([shards for _, _, shards, _ in runs[2]])
    for rank, hists in enumerate(per_rank):
        for tag, h in hists.items():  # the real tp=2 gradients against their own whole tensor
            _assert_is_histogram_of(h, full[tag], f"rank {rank} {tag}")
        weights = {tag: h for tag, h in hists.items() if tag.endswith("/weight")}
        _assert_same(weights, {tag: reference[tag] for tag in weights}, f"tp=2 rank {rank} weights")


def _fsdp(tp, replicate):
    """GPT at ``tp`` under FSDP2 over the rest of the ranks (every weight a DTensor split along
    dim 0 of its TP shard; ``replicate`` > 1: HSDP, replicated over that many groups): histograms
    and the whole weights and gradients (full_tensor and the TP shards assembled, in the test only)."""
    from bigdense.train.engines.fsdp import apply_fsdp, dp_mesh

    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    gpt = _gpt(ctx.tp_group)
    apply_fsdp(gpt, dp_mesh(ctx, replicate))
    idx = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    gpt(idx, idx).backward()
    shards = {name: (m.weight.full_tensor().detach(), m.weight.grad.full_tensor(), shard_spec_of(m.weight))
              for name, m in weighted_dense_layers(gpt).items()}
    return DenseLayerHistograms(gpt, ctx.tp_group).collect(), shards


@pytest.mark.parametrize("tp, replicate", [(2, 1), (1, 2)], ids=["tp2xfsdp2", "hsdp2x2"])
def test_fsdp_sharded_weights_give_the_unsharded_histograms(runs, tp, replicate):
    _, reference, _, _ = runs[1][0]
    results = run_ranks(_fsdp, 4, tp, replicate)
    for rank, (hists, _) in enumerate(results):
        full = _assemble([shards for _, shards in results[rank - rank % tp: rank - rank % tp + tp]])
        assert hists.keys() == reference.keys()
        for tag, h in hists.items():
            _assert_is_histogram_of(h, full[tag], f"rank {rank} {tag}")
        weights = {tag: h for tag, h in hists.items() if tag.endswith("/weight")}
        _assert_same(weights, {tag: reference[tag] for tag in weights}, f"fsdp rank {rank} weights")


def test_missing_and_non_finite_tensors_are_left_out_and_a_constant_fills_one_bin():
    model = nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(3, 4), "c": nn.Linear(3, 4)})
    with torch.no_grad():
        model["c"].weight.zero_()
    model["b"].weight.grad = torch.full((4, 3), float("nan"))
    model["c"].weight.grad = torch.full((4, 3), float("inf"))
    hists = DenseLayerHistograms(model, None).collect()
    assert sorted(hists) == ["hist/a/weight", "hist/b/weight", "hist/c/weight"]  # no grad for a; b's, c's not finite
    flat = hists["hist/c/weight"]
    assert (flat.min, flat.max, flat.bucket_limits[0], flat.bucket_limits[-1]) == (0.0, 0.0, -0.5, 0.5)
    assert flat.bucket_counts[BINS // 2 + 1] == 12 and sum(flat.bucket_counts) == 12
    # Values on the edges go to the bin they open; the maximum closes the last bin (torch.histogram's rule).
    on_edges = nn.Linear(13, 5, bias=False)
    with torch.no_grad():
        on_edges.weight.copy_(torch.arange(65.0).reshape(5, 13))
    (h,) = DenseLayerHistograms(on_edges, None).collect().values()
    assert h.bucket_limits == [float(i) for i in range(65)] and h.bucket_counts == [0.0] + [1.0] * 63 + [2.0]
    with pytest.raises(ValueError, match="bins must be a positive int"):
        DenseLayerHistograms(model, None, bins=0)


def test_the_event_file_holds_the_histograms(tmp_path, runs):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    hists = runs[1][0][0]
    log = MetricsLog(tmp_path, enabled=True, tensorboard=True)
    log.write_histograms(hists, step=10)
    log.close()
    MetricsLog(tmp_path / "other", enabled=False, tensorboard=True).write_histograms(hists, step=10)  # not main: nothing
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["histograms"]) == sorted(hists)
    (event,) = events.Histograms("hist/mlp.up/weight")
    h, value = hists["hist/mlp.up/weight"], event.histogram_value
    assert event.step == 10 and (value.min, value.max, value.num) == (h.min, h.max, h.num)
    assert list(value.bucket) == h.bucket_counts and list(value.bucket_limit) == pytest.approx(h.bucket_limits)


def _world_head():
    ctx = bd.init_parallel(tp=1)
    head = bd.ParallelClassifierHead(8, 10, shard="world", tp_group=ctx.tp_group, dp_group=ctx.dp_group)
    with pytest.raises(ValueError, match="split over every rank"):
        DenseLayerHistograms(nn.ModuleDict({"head": head}), ctx.tp_group)
    return True


def test_a_world_sharded_head_is_refused_rather_than_counted_over_tp_only():
    assert run_ranks(_world_head, 2) == [True, True]


@pytest.mark.slow  # launches launch/train.py under torchrun (two fresh processes, a data cache)
def test_a_tp2_training_run_with_tensorboard_writes_the_histograms_at_its_logging_steps(tmp_path, small):
    import subprocess

    from helpers import BIN, TRAIN

    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir = tmp_path / "run"
    out = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN, *small,
                          "trainer.max_steps=4", "trainer.tensorboard=true", f"trainer.run_dir={run_dir}"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    events = accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})  # 0: keep all
    events.Reload()
    tags = events.Tags()["histograms"]
    for layer in ("blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.0.mlp.down", "head", "tok_emb"):
        for kind in ("weight", "grad"):
            assert [e.step for e in events.Histograms(f"hist/{layer}/{kind}")] == [2, 4], (layer, kind, tags)
