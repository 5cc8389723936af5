"""bd.prune against plain torch on the unsharded weights, at tp = 1, 2 and 3 (uneven shards).

The references are written here on the full weights gathered before pruning: unstructured, a
stable ``torch.sort`` of the concatenated ``|w|`` (the layers in model order, each row-major), the
first ``round(s * N)`` going -- ties go by flat index, which the stable sort keeps; n:m, a stable
sort inside each group of m along the input dimension; rows, each hidden unit's norms (float64,
rounded to float32) sorted stably. Masks and shrunk weights are compared bit for bit (they are
selections and copies: no arithmetic). Outputs of a shrunk pair are compared with its twin that
zeroes the pruned units (atol 2e-6: fp32 matmuls over 8-24 terms of size ~1, summed in another
order with or without the zero terms -- a few ulps).
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import bigdense as bd
from bigdense.config import PruneConfig
from bigdense.errors import ConfigError
from bigdense.compression.prune_schedule import GradualPruning, check_prune_schedule, sparsity_at
from bigdense.parallel import comm
from bigdense.testing import RankError, run_ranks

from helpers import TinyLM, batch

OUT_TOL = dict(atol=2e-6, rtol=0.0)
SPARSITY, ROWS_SPARSITY = 0.55, 0.4


class Net(nn.Module):
    """Every kind of layer: column (10 rows: 4, 3, 3 at tp=3), row (24 inputs), a SwiGLU MLP, a plain
    Linear (replicated over TP), a column -> row pair in a Sequential with dropout between, a head
    (not pruned by default). Input widths but seq.3's are multiples of 4 on every rank (n:m)."""

    def __init__(self):
        super().__init__()
        self.col = bd.ColumnParallelLinear(8, 10)
        self.row = bd.RowParallelLinear(24, 8)
        self.mlp = bd.ParallelMLP(8, 24, "swiglu")
        self.lin = nn.Linear(8, 5)
        first = bd.ColumnParallelLinear(8, 14)
        self.seq = nn.Sequential(first, nn.ReLU(), bd.ShardedDropout(0.1, 14, first.partition_start),
                                 bd.RowParallelLinear(14, 8))
        self.head = bd.ParallelClassifierHead(8, 11)


DENSE = ["col", "row", "mlp.gate", "mlp.up", "mlp.down", "lin", "seq.0", "seq.3"]


def _full(layer, name):
    """The global tensor ``name`` of ``layer`` (gathered with plain collectives)."""
    value = getattr(layer, name).detach()
    spec = layer.shard_spec(name) if isinstance(layer, bd.TensorParallelModule) and layer.tp_size > 1 else None
    if spec is None:
        return value.clone()
    full = comm.all_gather_dim(value.float(), spec.dim, layer.tp_group, spec.sizes)
    return full.to(value.dtype)


def _integer_weights(net, seed):
    """Weights in {-3 .. 3}: ties everywhere, including at the threshold."""
    g = torch.Generator().manual_seed(seed)
    for layer in (net.col, net.row):
        full = torch.randint(-3, 4, (layer.out_features, layer.in_features), generator=g).float()
        layer.load_dense_(full, _full(layer, "bias"))


def _structures(tp):
    """Each structure on a fresh Net: the full weights before, the full masks (or shrunk weights) after."""
    bd.init_parallel(tp=tp)
    out = {}
    for structure, ties in (("unstructured", False), ("unstructured", True), ("n:m", False), ("n:m", True)):
        torch.manual_seed(0)
        net = Net()
        if ties:
            _integer_weights(net, 7)
        names = ["col", "row"] if ties else [n for n in DENSE if n != "seq.3"] if structure == "n:m" else None
        before = {n: _full(net.get_submodule(n), "weight") for n in (names or DENSE)}
        sparsity = SPARSITY if structure == "unstructured" else None
        report = bd.prune(net, sparsity, structure, layers=names)
        masks = {n: _full(net.get_submodule(n), "weight_mask") for n in before}
        weights = {n: _full(net.get_submodule(n), "weight") for n in before}
        out[structure, ties] = before, masks, weights, report.layers, report.threshold
    torch.manual_seed(0)
    net = Net().eval()
    paired = [n for n in DENSE if n not in ("col", "row", "lin")]
    before = {f"{n}.{p}": _full(net.get_submodule(n), p) for n in paired for p in ("weight", "bias")}
    report = bd.prune(net, ROWS_SPARSITY, "rows")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    y_mlp = net.mlp(x).detach()
    first = net.seq[0]
    h = first(x)
    y_seq = net.seq[3](net.seq[2](F.relu(h))).detach()
    after = {f"{n}.{p}": _full(net.get_submodule(n), p) for n in paired for p in ("weight", "bias")}
    dropout = (net.seq[2].global_size, net.seq[2].offset, first.partition_start)
    out["rows"] = before, after, report.layers, report.new_sizes, x, y_mlp, y_seq, dropout, net.mlp.d_hidden
    return out


@pytest.fixture(scope="module")
def runs():
    """Every structure at tp 1, 2, 3 (rank 0's view: every rank gathers the same tensors)."""
    return {tp: run_ranks(_structures, tp, tp)[0] for tp in (1, 2, 3)}


def _unstructured_reference(weights: dict, sparsity: float) -> dict:
    flat = torch.cat([w.abs().flatten() for w in weights.values()])
    k = math.floor(sparsity * flat.numel() + 0.5)
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[torch.sort(flat, stable=True).indices[:k]] = False
    sizes = [w.numel() for w in weights.values()]
    return {n: part.view(w.shape) for (n, w), part in zip(weights.items(), keep.split(sizes))}


def _n_m_reference(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    groups = w.abs().reshape(-1, m)
    keep = torch.ones_like(groups, dtype=torch.bool)
    keep.scatter_(1, torch.sort(groups, dim=1, stable=True).indices[:, : m - n], False)
    return keep.view(w.shape)


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_unstructured_masks_are_the_global_threshold_at_every_tp(runs, ties):
    reference = None
    for tp, result in runs.items():
        before, masks, weights, counts, threshold = result["unstructured", ties]
        if reference is None:
            reference = _unstructured_reference(before, SPARSITY)
            total = sum(w.numel() for w in before.values())
            assert sum(t - k for k, t in counts.values()) == math.floor(SPARSITY * total + 0.5)
            pruned = torch.cat([w.abs().flatten()[~reference[n].flatten()] for n, w in before.items()])
            assert threshold == pruned.max().item()
        for name, mask in masks.items():
            assert torch.equal(mask, reference[name]), (tp, name)
            assert torch.equal(weights[name], before[name] * mask), (tp, name)  # zeroed, the rest untouched
            assert counts[name] == (int(mask.sum()), mask.numel())
    if not ties:
        assert "head" not in counts and sorted(counts) == sorted(DENSE)


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_n_m_masks_keep_n_of_every_m_along_the_input_at_every_tp(runs, ties):
    for tp, result in runs.items():
        before, masks, weights, counts, _ = result["n:m", ties]
        for name, mask in masks.items():
            assert torch.equal(mask, _n_m_reference(before[name])), (tp, name)
            assert torch.equal(mask.view(-1, 4).sum(1), torch.full((mask.numel() // 4,), 2)), (tp, name)
            assert torch.equal(weights[name], before[name] * mask)


def _unit_scores(inputs, down):
    score = down.double().pow(2).sum(0).sqrt()
    for w in inputs:
        score = score * w.double().pow(2).sum(1).sqrt()
    return score.float()


def test_rows_shrink_the_pairs_to_their_masked_twins_at_every_tp(runs):
    for tp, result in runs.items():
        before, after, counts, sizes, x, y_mlp, y_seq, dropout, d_hidden = result["rows"]
        kept = {}
        for pair, inputs, down in (("mlp", ["mlp.gate", "mlp.up"], "mlp.down"), ("seq.0", ["seq.0"], "seq.3")):
            scores = _unit_scores([before[f"{n}.weight"] for n in inputs], before[f"{down}.weight"])
            h = scores.numel()
            drop = math.floor(ROWS_SPARSITY * h + 0.5)
            keep = torch.sort(torch.sort(scores, stable=True).indices[drop:]).values
            kept[pair] = keep
            assert counts[pair] == (len(keep), h) and sizes[pair] == (h, len(keep))
            for n in inputs:  # the kept units' rows, in order: bit-identical copies
                assert torch.equal(after[f"{n}.weight"], before[f"{n}.weight"][keep])
                assert torch.equal(after[f"{n}.bias"], before[f"{n}.bias"][keep])
            assert torch.equal(after[f"{down}.weight"], before[f"{down}.weight"][:, keep])
            assert torch.equal(after[f"{down}.bias"], before[f"{down}.bias"])
        assert d_hidden == len(kept["mlp"]) == 14
        # Twins on the full weights with the pruned units zeroed (their outputs removed).
        unit = torch.zeros(24, dtype=torch.bool)
        unit[kept["mlp"]] = True
        zero = lambda n: before[f"{n}.weight"] * unit[:, None]  # noqa: E731
        hidden = F.silu(x @ zero("mlp.gate").t() + before["mlp.gate.bias"] * unit) * (
            x @ zero("mlp.up").t() + before["mlp.up.bias"] * unit)
        torch.testing.assert_close(y_mlp, hidden @ (before["mlp.down.weight"] * unit).t() + before["mlp.down.bias"],
                                   **OUT_TOL)
        unit = torch.zeros(14, dtype=torch.bool)
        unit[kept["seq.0"]] = True
        hidden = F.relu(x @ (before["seq.0.weight"] * unit[:, None]).t() + before["seq.0.bias"] * unit)
        torch.testing.assert_close(y_seq, hidden @ (before["seq.3.weight"] * unit).t() + before["seq.3.bias"],
                                   **OUT_TOL)
        global_size, offset, start = dropout
        assert global_size == len(kept["seq.0"]) and offset == start  # the dropout follows the new split


def _row_split_cuts_groups():
    bd.init_parallel(tp=3)
    bd.prune(bd.RowParallelLinear(16, 4), None, "n:m")


def test_n_m_refuses_a_row_split_that_cuts_a_group():
    with pytest.raises(RankError, match=r"RowParallelLinear.*in_features=16 over tp=3 into shards of \[6, 5, 5\], "
                                        r"which cuts groups of m=4"):
        run_ranks(_row_split_cuts_groups, 3)


def test_bad_requests_name_the_value():
    lin = nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\].*got 1.5"):
        bd.prune(lin, 1.5)
    with pytest.raises(ValueError, match=r"n=2, m=4 prunes exactly 1 - n/m = 0.5.*got 0.3"):
        bd.prune(lin, 0.3, "n:m")
    with pytest.raises(ValueError, match=r"in_features=6, not a multiple of m=4"):
        bd.prune(nn.Linear(6, 4), None, "n:m")
    with pytest.raises(ValueError, match=r"structure='columns' is not one of"):
        bd.prune(lin, 0.5, "columns")
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\*' matches no module of Net"):
        bd.prune(Net(), 0.5, layers=["blocks.*"])
    with pytest.raises(TypeError, match=r"holds no column -> row pair"):
        bd.prune(lin, 0.5, "rows")
    with pytest.raises(ValueError, match=r"removes all 14 hidden units of seq.0"):
        bd.prune(Net(), 1.0, "rows", layers=["seq.0"])


def _train_pruned(steps):
    """Three AdamW steps build momentum, then prune 60% and train ``steps`` more, clipped."""
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    net = bd.ParallelMLP(8, 12, "swiglu")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(4)]

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        bd.clip_grad_norm_(list(net.parameters()), 0.05, tp_group=ctx.tp_group)  # norms ~0.5: it bites
        opt.step()
        return loss.item()

    for i in range(3):
        step(i)
    bd.prune(net, 0.6)
    layers = [net.gate, net.up, net.down]
    masks = [layer.weight_mask.clone() for layer in layers]
    start = [layer.weight.detach().clone() for layer in layers]
    losses, moved_by_adam = [], False
    for i in range(steps):
        losses.append(step(i))
        for layer in layers:
            assert not layer.weight.grad[~layer.weight_mask].any()  # the gradient of weight * mask
            moved_by_adam |= bool(layer.weight.detach()[~layer.weight_mask].any())
        assert bd.apply_masks(net) == 3
    assert all(torch.equal(layer.weight_mask, m) for layer, m in zip(layers, masks))
    zeros = all(not layer.weight.detach()[~layer.weight_mask].any() for layer in layers)
    trained = all(not torch.equal(layer.weight.detach()[m], s[m]) for layer, s, m in zip(layers, start, masks))
    return zeros, trained, moved_by_adam, losses[0], losses[-1]


def test_a_pruned_layer_trains_50_steps_with_its_zeros_intact():
    """AdamW's moments from before the pruning would move the zeros (seen before apply_masks)."""
    for zeros, trained, moved_by_adam, first, last in run_ranks(_train_pruned, 2, 50):
        assert zeros and trained and moved_by_adam and last < first


def _save_pruned(ckpt):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = TinyLM(dropout=0.0)
    bd.prune(model, 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for pos in range(2):
        model(*batch(pos)).backward()
        opt.step()
        opt.zero_grad()
        bd.apply_masks(model)
    bd.save_checkpoint(ckpt, model, opt, step=2)
    model.eval()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    layers = {n: model.get_submodule(n) for n in ("mlp.gate", "mlp.up", "mlp.down")}
    return ({n: (_full(layer, "weight"), _full(layer, "weight_mask")) for n, layer in layers.items()},
            model.mlp(x).detach(), x, ctx.tp_size)


def _load_pruned(ckpt, dense_file):
    bd.init_parallel(tp=3)
    torch.manual_seed(1)  # other values: the load must bring them
    model = TinyLM(dropout=0.0)  # unpruned: the load gives the layers the checkpoint has masks for theirs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bd.load_checkpoint(ckpt, model, opt)
    masked = [n for n, m in model.named_modules() if getattr(m, "weight_mask", None) is not None]
    layers = {n: model.get_submodule(n) for n in ("mlp.gate", "mlp.up", "mlp.down")}
    loaded = {n: (_full(layer, "weight"), _full(layer, "weight_mask")) for n, layer in layers.items()}
    model.eval()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    y = model.mlp(x).detach()
    dense = model.mlp.to_dense()
    if bd.get_default_context().rank == 0:
        bd.export_dense(ckpt, dense_file)
    return masked, loaded, y, dense(x).detach()


def test_checkpoint_at_tp2_loads_its_masks_at_tp3_and_exports_the_masked_model(tmp_path):
    ckpt, dense_file = tmp_path / "ckpt", tmp_path / "dense.safetensors"
    saved, y_saved, x, _ = run_ranks(_save_pruned, 2, str(ckpt))[0]
    masked, loaded, y_loaded, y_to_dense = run_ranks(_load_pruned, 3, str(ckpt), str(dense_file))[0]
    assert masked == ["mlp.gate", "mlp.up", "mlp.down"]
    for name, (weight, mask) in saved.items():
        assert not mask.all() and torch.equal(weight, weight * mask)  # pruned, and zero there after training
        assert torch.equal(loaded[name][0], weight) and torch.equal(loaded[name][1], mask)
    torch.testing.assert_close(y_loaded, y_saved, **OUT_TOL)
    torch.testing.assert_close(y_to_dense, y_saved, **OUT_TOL)
    # The export: plain names, the zeroed weights, and each mask beside its weight.
    exported = load_file(dense_file)
    plain = bd.layers.mlp.DenseMLP(6, 10, "swiglu")
    mlp_state = {k[len("mlp."):]: v for k, v in exported.items() if k.startswith("mlp.")}
    unexpected = plain.load_state_dict(mlp_state, strict=False).unexpected_keys
    assert sorted(unexpected) == ["down.weight_mask", "gate.weight_mask", "up.weight_mask"]
    for name, (weight, mask) in saved.items():
        assert torch.equal(exported[f"{name}.weight"], weight) and torch.equal(exported[f"{name}.weight_mask"], mask)
    torch.testing.assert_close(plain(x).detach(), y_saved, **OUT_TOL)


def test_the_cubic_schedule_and_its_rules():
    cfg = PruneConfig(sparsity=0.8, start_step=10, every=5, steps=4)
    events = {done: sparsity_at(cfg, done) for done in range(0, 40) if sparsity_at(cfg, done) is not None}
    assert list(events) == [10, 15, 20, 25]
    for i, value in enumerate(events.values()):
        assert math.isclose(value, 0.8 * (1 - (1 - (i + 1) / 4) ** 3))
    assert events[25] == pytest.approx(0.8)
    assert sparsity_at(PruneConfig(), 0) is None  # off
    check_prune_schedule(cfg, "ddp")
    for bad, engine, message in [
        (dict(structure="rows"), "ddp", r"prune.structure='rows' is not one of"),
        (dict(structure="n:m", sparsity=0.5, steps=3), "ddp", r"prune.steps=3: .*set prune.steps=1"),
        (dict(structure="n:m", sparsity=0.6), "ddp", r"prune.sparsity=0.6: .*1 - n/m = 0.5"),
        (dict(every=0), "ddp", r"prune.every must be a positive integer"),
        ({}, "deepspeed", r"needs engine=ddp"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_prune_schedule(PruneConfig(**{**dict(sparsity=0.5), **bad}), engine)


class _Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = bd.ParallelMLP(8, 12, "gelu")

    def forward(self, x, y):
        return F.mse_loss(self.mlp(x), y)


def _gradual(steps):
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = _Regressor()
    cfg = PruneConfig(sparsity=0.75, start_step=2, every=3, steps=3)
    pruner = GradualPruning(model, cfg)  # masks attached (all True) before the engine
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OptimConfig(warmup_steps=1),
                             precision_cfg=PrecisionConfig(), micro_batch_size=4, max_steps=steps)
    g = torch.Generator().manual_seed(2)
    layers = [model.mlp.up, model.mlp.down]
    achieved, intact = {}, True
    for step in range(1, steps + 1):
        report = pruner.before_step(step)
        if report is not None:
            achieved[step] = report.achieved
        engine.train_step([(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))])
        intact &= all(not layer.weight.detach()[~layer.weight_mask].any() for layer in layers)
    return achieved, intact


def test_gradual_pruning_in_the_ddp_engine_follows_the_schedule_with_zeros_intact():
    for achieved, intact in run_ranks(_gradual, 2, 12):
        assert intact and list(achieved) == [3, 6, 9]
        total = 2 * 12 * 8
        for i, value in enumerate(achieved.values()):
            expected = math.floor(0.75 * (1 - (1 - (i + 1) / 3) ** 3) * total + 0.5) / total
            assert value == pytest.approx(expected)


def _gpt(tp):
    from bigdense.models import GPT, GPTConfig

    bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=2, d_hidden=30, max_seq_len=8,
                          activation="swiglu")).eval()
    idx = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(4))
    unstructured = bd.prune(model, 0.3)
    rows = bd.prune(model, 0.5, "rows")
    return unstructured.layers, rows.layers, rows.new_sizes, model(idx, idx).item()


def test_a_gpt_prunes_its_dense_layers_and_its_mlps_alike_at_tp_1_and_2():
    """Every MLP loses the same fraction of units; the loss agrees across TP sizes to fp32 rounding
    of the sharded sums (1e-5 relative)."""
    (one,), (two, _) = run_ranks(_gpt, 1, 1), run_ranks(_gpt, 2, 2)
    assert one[:3] == two[:3]
    unstructured, rows, sizes, _ = one
    assert sorted(unstructured) == sorted(f"blocks.{b}.{n}" for b in range(2)
                                          for n in ("attn.qkv", "attn.out", "mlp.gate", "mlp.up", "mlp.down"))
    assert sizes == {f"blocks.{b}.mlp": (30, 15) for b in range(2)} and rows == {k: (15, 30) for k in sizes}
    assert math.isfinite(one[3]) and abs(one[3] - two[3]) <= 1e-5 * abs(one[3])


def _fsdp_step():
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig

    ctx = bd.init_parallel(tp=1, dp=2)
    torch.manual_seed(0)
    model = _Regressor()
    bd.prune(model, 0.5)
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="fsdp"), optim_cfg=OptimConfig(warmup_steps=1),
                             precision_cfg=PrecisionConfig(), micro_batch_size=2, max_steps=2)
    engine.train_step([(torch.randn(2, 8), torch.randn(2, 8))])


def test_fsdp_refuses_a_pruned_model_at_its_first_step():
    """Its weights are DTensors, to which the masks' gradient hooks do not reach."""
    with pytest.raises(RankError, match=r"mlp.up: a pruned layer whose weight is FSDP-sharded .* engine=ddp"):
        run_ranks(_fsdp_step, 2)
