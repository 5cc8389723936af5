"""int8 weights (`bd.quantize_int8`) and sparse products (`bd.SparseLinear`, `bd.to_sparse`) of dense
layers, sharded or not, against independent computations on the full weight in plain torch.

Tolerances. int8 values and scales are compared bit for bit: the definition (per row of the full
weight, ``s = max |W| / 127``, ``q = round(W / s)``) is elementwise once the row maxima are known,
and a maximum does not depend on the order it is taken in. Outputs of the same arithmetic on
different layouts (a row layer's partial sums all-reduced, a sparse product summing its nonzeros
in another order than a dense GEMM) differ by fp32 rounding only: sums of at most 26 products of
values below ~10 in magnitude, so 1e-5 absolute and relative (~100 ulps) covers them. Against the
float layer, each int8 weight is off by at most ``s_j / 2``, so output ``j`` by at most
``s_j / 2 * ||x||_1`` (plus that rounding). bf16 activations (the fused kernel) round the inputs
and outputs to 8 bits of mantissa: 1% of the output's scale. A stand-in's ``to_dense`` is compared
bit for bit: it gathers ``q * s`` (or the kept weights), elementwise, as the reference computes them.
"""
import math

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.layers.mlp import DenseMLP
from bigdense.compression.sparse import semi_structured_refusal
from bigdense.parallel import comm
from bigdense.parallel.sharding import ShardSpec
from bigdense.testing import run_ranks

FP32 = dict(atol=1e-5, rtol=1e-5)
SHAPES = {"column": (13, 10), "row": (11, 10)}  # (out, in): uneven over 2 and 3 ranks


def _dense(out_f, in_f, seed, dtype=torch.float32):
    """An nn.Linear whose rows differ in magnitude by 1000x (so do their scales); row 1 is zero (scale 0)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * torch.logspace(-2, 1, out_f)[:, None])
        lin.weight[1].zero_()
        lin.bias.uniform_(-1, 1, generator=g)
    return lin.to(dtype)


def reference_int8(w):
    """The definition, on the full weight: per row j, s_j = max_i |W_ji| / 127 (in W's dtype), q = round(W / s)."""
    s = (w.abs().amax(dim=1).float() / 127).to(w.dtype)
    q = torch.round(w.float() / torch.where(s > 0, s, torch.ones_like(s)).float()[:, None])
    return q.clamp(-127, 127).to(torch.int8), s


def _x(rows, width, seed=7):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


# ---- int8 ----------------------------------------------------------------------------------------
def _int8_ranks(tp):
    bd.init_parallel(tp=tp)
    got = {}
    for seed, (kind, (out_f, in_f)) in enumerate(SHAPES.items()):
        lin = _dense(out_f, in_f, seed)
        layer = (bd.ColumnParallelLinear.from_dense(lin, gather_output=True) if kind == "column"
                 else bd.RowParallelLinear.from_dense(lin, input_is_parallel=False))
        layer = bd.quantize_int8(layer)
        assert isinstance(layer, bd.Int8Linear) and layer.weight.dtype == torch.int8
        got[kind] = (layer.weight.clone(), layer.weight_scale.clone(), layer(_x(6, in_f)).detach())
    torch.manual_seed(0)  # a TP-invariant initialisation: the same MLP at every tp
    mlp = bd.ParallelMLP(16, 26, "swiglu")
    dense = mlp.to_dense()
    bd.quantize_int8(mlp)
    assert all(isinstance(getattr(mlp, p), bd.Int8Linear) for p in ("gate", "up", "down"))
    got["mlp"] = (dense.state_dict(), mlp(_x(5, 16)).detach())
    return got


def _assemble(kind, per_rank):
    """The full int8 weight and scales from every rank's shards."""
    q = torch.cat([r[0] for r in per_rank], dim=0 if kind == "column" else 1)
    if kind == "column":
        return q, torch.cat([r[1] for r in per_rank])
    assert all(torch.equal(r[1], per_rank[0][1]) for r in per_rank)  # a row layer's scales: whole on every rank
    return q, per_rank[0][1]


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_int8_is_bit_exact_at_every_tp_and_within_its_bound(tp):
    results = run_ranks(_int8_ranks, tp, tp)
    for seed, (kind, (out_f, in_f)) in enumerate(SHAPES.items()):
        lin = _dense(out_f, in_f, seed)
        q_ref, s_ref = reference_int8(lin.weight.detach())
        q, s = _assemble(kind, [r[kind] for r in results])
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), kind
        assert s[1] == 0 and not q[1].any()  # the zero row
        x = _x(6, in_f)
        for r in results:  # every rank holds the whole output
            y = r[kind][2]
            torch.testing.assert_close(y, x @ (q_ref.float() * s_ref[:, None]).t() + lin.bias.detach(), **FP32)
            bound = 0.5 * s_ref * x.abs().sum(1, keepdim=True) + 1e-5
            assert ((y - lin(x).detach()).abs() <= bound).all(), kind
    # ParallelMLP's projections go through its own path (called as modules, one all-reduce).
    state, _ = results[0]["mlp"]
    ref = DenseMLP(16, 26, "swiglu")
    ref.load_state_dict(state)
    with torch.no_grad():
        for proj in (ref.gate, ref.up, ref.down):
            q_ref, s_ref = reference_int8(proj.weight)
            proj.weight.copy_(q_ref.float() * s_ref[:, None])
    for r in results:
        torch.testing.assert_close(r["mlp"][1], ref(_x(5, 16)).detach(), **FP32)


def test_int8_bf16_activations_use_the_fused_kernel_and_odd_widths_fall_back():
    for in_f, fused in ((128, True), (10, False)):
        layer = bd.quantize_int8(_dense(24, in_f, 3, torch.bfloat16))
        x = _x(5, in_f).bfloat16()
        assert layer._fused(x) == fused
        expect = x.float() @ layer.dequantized_weight().float().t() + layer.bias.float()
        torch.testing.assert_close(layer(x).float(), expect, atol=1e-2 * expect.abs().max().item(), rtol=1e-2)


def _save_int8_mlp(path):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    mlp = bd.quantize_int8(bd.ParallelMLP(16, 26, "gelu"))
    bd.save_checkpoint(path, mlp, step=0)
    return mlp(_x(5, 16)).detach()


def _load_int8_mlp(path):
    bd.init_parallel(tp=3)
    torch.manual_seed(1)  # other weights, overwritten by the load
    mlp = bd.quantize_int8(bd.ParallelMLP(16, 26, "gelu"))
    bd.load_checkpoint(path, mlp, load_rng=False)
    return mlp(_x(5, 16)).detach()


def test_int8_checkpoint_reshards_and_its_export_loads_into_plain_pytorch(tmp_path):
    y = run_ranks(_save_int8_mlp, 2, tmp_path / "ckpt")[0]
    for y3 in run_ranks(_load_int8_mlp, 3, tmp_path / "ckpt"):  # int8 weights and scales resharded 2 -> 3
        torch.testing.assert_close(y3, y, **FP32)
    bd.export_dense(tmp_path / "ckpt", tmp_path / "int8.safetensors")
    sd = safetensors.torch.load_file(tmp_path / "int8.safetensors")
    assert sd["up.weight"].dtype == torch.int8 and sd["up.weight_scale"].shape == (26,)
    # docs/compression.md's lines (examples/sparse_int8.py): int8 weights and scales into float weights.
    plain = {k: v for k, v in sd.items() if not k.endswith(".weight_scale")}
    plain.update({k[:-len("_scale")]: sd[k[:-len("_scale")]].float() * v[:, None] for k, v in sd.items() if k.endswith(".weight_scale")})
    dense = DenseMLP(16, 26, "gelu")
    dense.load_state_dict(plain)
    torch.testing.assert_close(dense(_x(5, 16)).detach(), y, **FP32)


def test_int8_bad_input():
    with pytest.raises(TypeError, match="expected an nn.Linear, ColumnParallelLinear or RowParallelLinear"):
        bd.quantize_int8(nn.Conv1d(3, 4, 1))
    with pytest.raises(ValueError, match=r"layers=\['nothing'\] matches no dense layer"):
        bd.quantize_int8(nn.Sequential(nn.Linear(3, 4)), layers=["nothing"])
    layer = bd.quantize_int8(nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"Int8Linear\(in_features=8, out_features=4.*expected input of shape \(\*, 8\)"):
        layer(torch.randn(2, 5))


# ---- a rank whose shard is empty (issue 34) ---------------------------------------------------------
def reference_mask(w, sparsity):
    """`bd.prune`'s unstructured rule on one layer: the round(sparsity * N) entries of smallest |w| go,
    ties by flat index (a stable sort)."""
    order = torch.sort(w.abs().flatten(), stable=True).indices
    keep = torch.ones(w.numel(), dtype=torch.bool)
    keep[order[:round(sparsity * w.numel())]] = False
    return keep.reshape(w.shape)


def _parallel_of(lin, kind):
    """``lin`` as a row layer splitting its input here, or a column layer gathering its output. At
    tp=3, RowParallelLinear(2, 5, input_is_parallel=False) splits its 2 input features 1/1/0 and
    ColumnParallelLinear(2, 2, gather_output=True) its 2 output features 1/1/0."""
    if kind == "row":
        return bd.RowParallelLinear.from_dense(lin, input_is_parallel=False)
    return bd.ColumnParallelLinear.from_dense(lin, gather_output=True)


def _pruned(layer):
    bd.prune(layer, 0.5)
    return layer


def _converted_by_to_sparse(layer):
    report = bd.to_sparse(_pruned(layer), min_speedup=1e-9, sample_tokens=4, repeats=1)
    assert [row["format"] for row in report.layers] == ["csr"], report.layers
    return report.module


STAND_INS = {"int8": bd.quantize_int8, "sparse": lambda layer: bd.SparseLinear(_pruned(layer)),
             "to_sparse": _converted_by_to_sparse}


def _empty_shard_ranks(kind):
    bd.init_parallel(tp=3)
    lin = _dense(5 if kind == "row" else 2, 2, seed=11)
    got = {}
    for name, make in STAND_INS.items():
        layer = make(_parallel_of(lin, kind))
        x = _x(4, 2).requires_grad_()
        y = layer(x)
        (y * _x(4, y.shape[-1], seed=8)).sum().backward()  # the input's gradient: the backward's collectives
        got[name] = (type(layer).__name__, y.detach(), x.grad, layer.to_dense().state_dict())
    layer = bd.quantize_int8(_parallel_of(_dense(lin.out_features, 2, seed=11, dtype=torch.bfloat16), kind))
    got["int8-bf16"] = layer(_x(4, 2).bfloat16()).float()  # bf16: the empty shard's width, 0, is a multiple of 64
    return got


@pytest.mark.parametrize("kind", ["row", "column"])
def test_stand_ins_with_an_empty_shard_equal_the_plain_product_tp3(kind):
    # Before (row): rank 2, holding none of the 2 input features, raised in InferenceLinear._local
    # ("cannot reshape tensor of 0 elements into shape [-1, 0]") while ranks 0 and 1 waited in the
    # all-reduce until the deadline; bd.to_sparse took the same path. Column: no to_dense.
    results = run_ranks(_empty_shard_ranks, 3, kind, timeout=120, collective_timeout=20)
    lin = _dense(5 if kind == "row" else 2, 2, seed=11)
    w, b = lin.weight.detach(), lin.bias.detach()
    q, s = reference_int8(w)
    effective = {"int8": q.float() * s[:, None], "sparse": w * reference_mask(w, 0.5)}
    effective["to_sparse"] = effective["sparse"]
    x, g = _x(4, 2), _x(4, w.shape[0], seed=8)
    for rank, got in enumerate(results):
        for name, weight in effective.items():
            what = f"{kind} {name} rank {rank}"
            layer_type, y, x_grad, dense = got[name]
            assert layer_type == ("Int8Linear" if name == "int8" else "SparseLinear"), what
            assert torch.equal(dense["weight"], weight) and torch.equal(dense["bias"], b), what
            # fp32 sums of at most 2 products (and zeros from the empty shard) in another order: ~1 ulp.
            torch.testing.assert_close(y, x @ weight.T + b, **FP32, msg=what)
            torch.testing.assert_close(x_grad, g @ weight, **FP32, msg=what)
        # bf16 inputs, weights and outputs: 8 bits of mantissa, 1% of the output's scale.
        x16 = x.bfloat16().float()
        q16, s16 = reference_int8(_dense(w.shape[0], 2, seed=11, dtype=torch.bfloat16).weight.detach())
        expect = x16 @ (q16.float() * s16.float()[:, None]).T + b.bfloat16().float()
        torch.testing.assert_close(got["int8-bf16"], expect, atol=1e-2 * expect.abs().max().item(), rtol=1e-2)


def _load_dense_ranks():
    bd.init_parallel(tp=2)
    out = {}
    for kind in ("row", "column"):
        first, second = _dense(5, 3, seed=1), _dense(5, 3, seed=2)
        for name, make in (("int8", bd.Int8Linear.from_dense), ("csr", bd.SparseLinear.from_dense)):
            loaded = make(_parallel_of(first, kind)).load_dense_(second)
            built = make(_parallel_of(second, kind))
            out[kind, name] = (loaded.to_dense().state_dict(), built.to_dense().state_dict(),
                               loaded(_x(4, 3)).detach(), built(_x(4, 3)).detach())
        int8 = bd.Int8Linear.from_dense(_parallel_of(first, kind))
        with pytest.raises(ValueError, match=r"Int8Linear\(in_features=3, out_features=5, tp=2, rank \d\): load_dense_ "
                                             r"expects an nn.Linear or a full weight of shape \(5, 3\), got \(3, 5\)"):
            int8.load_dense_(second.weight.T, second.bias)
    return out


def test_stand_ins_load_dense_rebuilds_them_as_from_dense_would():
    for got in run_ranks(_load_dense_ranks, 2, timeout=120, collective_timeout=20):
        for key, (loaded, built, y_loaded, y_built) in got.items():
            assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in loaded), key
            assert torch.equal(y_loaded, y_built), key


# ---- sparse --------------------------------------------------------------------------------------
def _pruned_pair(tp, sequence_parallel=False):
    torch.manual_seed(0)
    kw = dict(sequence_parallel=sequence_parallel)
    model = nn.Sequential(bd.ColumnParallelLinear(12, 26, **kw), nn.ReLU(), bd.RowParallelLinear(26, 12, **kw),
                          nn.Linear(12, 12))  # the last replicated on every TP rank
    bd.prune(model, 0.7)
    return model


def _sparse_ranks(tp):
    ctx = bd.init_parallel(tp=tp)
    model = _pruned_pair(tp)
    x = _x(6, 12)
    twin = nn.Sequential(model[0].to_dense(), nn.ReLU(), model[2].to_dense(), model[3])  # full masked weights
    sparse = nn.Sequential(*(bd.SparseLinear(m) if i != 1 else m for i, m in enumerate(model)))
    out = {"twin": twin(x).detach(), "masked": model(x).detach(), "sparse": sparse(x).detach()}
    out["never"] = bd.to_sparse(model, min_speedup=1e9, sample_tokens=8, repeats=1).layers
    out["always"] = bd.to_sparse(model, min_speedup=1e-9, sample_tokens=8, repeats=1).layers
    out["converted"] = model(x).detach()
    if tp > 1:  # under sequence parallelism: each rank its share of the sequence in and out
        sp = _pruned_pair(tp, sequence_parallel=True)[:3]
        xs = ShardSpec.balanced((2, 7, 12), 1, tp, ctx.tp_rank).slice_of(torch.randn(2, 7, 12))
        out["sp"] = (sp(xs).detach(), nn.Sequential(*(bd.SparseLinear(m) if i != 1 else m for i, m in
                                                      enumerate(sp)))(xs).detach())
    return out


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sparse_equals_the_masked_dense_layers_and_ranks_decide_alike(tp):
    results = run_ranks(_sparse_ranks, tp, tp)
    for r in results:
        torch.testing.assert_close(r["masked"], r["twin"], **FP32)
        torch.testing.assert_close(r["sparse"], r["twin"], **FP32)
        torch.testing.assert_close(r["converted"], r["twin"], **FP32)
        assert [row["format"] for row in r["never"]] == [None] * 3
        assert [row["format"] for row in r["always"]] == ["csr"] * 3
        assert [row["layer"] for row in r["always"]] == ["0", "2", "3"]
        if tp > 1:
            torch.testing.assert_close(r["sp"][1], r["sp"][0], **FP32)
    # The timings were all-reduced: every rank decided on the same numbers.
    assert all(r["never"] == results[0]["never"] and r["always"] == results[0]["always"] for r in results)


def test_sparse_formats_and_bad_input():
    lin = nn.Linear(16, 8)
    bd.prune(lin, None, "n:m")  # 2:4
    reason = semi_structured_refusal(lin.weight.detach())
    if not torch.cuda.is_available():
        assert "CUDA device" in reason
        with pytest.raises(ValueError, match="semi_structured.*CUDA device"):
            bd.SparseLinear(lin, "semi_structured")
    with pytest.raises(ValueError, match="format='coo' is not one of"):
        bd.SparseLinear(lin, "coo")
    with pytest.raises(ValueError, match="no pruned layer"):
        bd.to_sparse(nn.Sequential(nn.Linear(4, 4)))
    assert bd.SparseLinear(lin).state_dict().keys() == {"bias"}  # the sparse weight is not saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="2:4 sparse kernels need a CUDA GPU")
def test_semi_structured_equals_the_masked_layer_on_a_gpu():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("2:4 sparse kernels need compute capability 8.0 or later")
    lin = nn.Linear(128, 128, device="cuda", dtype=torch.float16)
    bd.prune(lin, None, "n:m")
    layer = bd.SparseLinear(lin, "semi_structured")
    x = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    # fp16 outputs of sums of 64 products: 1e-2 relative.
    torch.testing.assert_close(layer(x), lin(x), atol=1e-2, rtol=1e-2)
    report = bd.to_sparse(nn.Sequential(lin), min_speedup=1e-9)
    assert report.layers[0]["format"] in ("semi_structured", "csr")


def test_bench_sparse_quick_runs(tmp_path):
    """`python -m bigdense.bench.sparse --quick`: every contender of part 1, and part 2's prune and
    fine-tune (3 s on a quiet machine, 10 s loaded)."""
    from bigdense.bench.sparse import main

    rows = main(["--quick", "--gpt-overrides", f"data.cache_dir={tmp_path}", "--json", str(tmp_path / "out.jsonl")])
    layer_rows = [r for r in rows if "contender" in r]
    assert {r["contender"] for r in layer_rows} == {"dense", "csr-90", "csr-95", "int8", "dense-bf16", "int8-bf16",
                                                    "dynamic"}
    for r in layer_rows:
        # The CSR product's own rounding; int8 and bf16 within their quantisation (Part 1's docstring).
        assert r["relative_error"] < (1e-5 if r["contender"].startswith("csr") else 5e-2), r
    gpt = rows[-1]
    assert gpt["d_hidden_after"] == gpt["d_hidden_before"] // 2 and gpt["mlp_params_after"] < gpt["mlp_params_before"]
    assert all(math.isfinite(gpt[k]) for k in ("loss_trained", "loss_pruned", "loss_finetuned", "loss_control"))
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == len(rows)
