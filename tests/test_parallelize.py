"""bd.parallelize: plain models converted in place compute what they computed before, at tp = 2 and 3.

Sizes are uneven at both TP sizes (hidden 10 and 7, vocabulary 13 and 11). Outputs are compared
with the unconverted copy of the same model; the only difference allowed is fp32 rounding from the
order of the TP sums (row-parallel partial products and the embedding's masked lookups are
all-reduced): atol/rtol 1e-5 on values of order 1, about 100 ulps.
"""
import copy

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.parallel import comm
from bigdense.testing import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def _mlp_stack():
    return nn.Sequential(
        nn.Linear(6, 10), nn.GELU(), nn.Dropout(0.1), nn.Linear(10, 5),
        nn.LayerNorm(5),  # not element-wise: 3 -> 5 is no pair
        nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3),
    )


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=10, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        self.out = nn.Linear(8, 4)  # a lone linear: stays dense

    def forward(self, ids, pad_mask=None):
        return self.out(self.encoder(self.emb(ids), src_key_padding_mask=pad_mask))


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mlp = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(h))


def _convert_and_compare(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    ids = torch.randint(0, 13, (3, 5))
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True  # with a padding mask an unconverted encoder would take the nested-tensor path

    # 1. nn.Sequential: two column/row pairs, dropout between the first becomes ShardedDropout.
    plain = _mlp_stack()
    model = bd.parallelize(copy.deepcopy(plain))
    assert model.bd_parallel_plan == {"0": "column", "3": "row", "5": "column", "7": "row"}
    assert isinstance(model[2], bd.ShardedDropout) and isinstance(model[4], nn.LayerNorm)
    plain.eval(), model.eval()
    torch.testing.assert_close(model(x), plain(x), **TOL)
    # Gradients: each rank's weight gradient is its slice of the dense one.
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    spec = model[0].shard_spec("weight")
    torch.testing.assert_close(model[0].weight.grad, spec.slice_of(plain[0].weight.grad), **TOL)
    torch.testing.assert_close(model[7].bias.grad, plain[7].bias.grad, **TOL)

    # 2. Transformer encoder: linear1/linear2 of each layer and the embedding; attention stays dense.
    plain = _Encoder()
    expected_plan = {"emb": "vocab"}
    for i in range(2):
        expected_plan.update({f"encoder.layers.{i}.linear1": "column", f"encoder.layers.{i}.linear2": "row"})
    assert bd.tp_plan(plain) == expected_plan
    model = bd.parallelize(copy.deepcopy(plain))
    assert model.bd_parallel_plan == expected_plan
    assert type(model.encoder.layers[0].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model.out) is nn.Linear
    plain.eval(), model.eval()
    with torch.no_grad():  # where the fused fast paths would run
        torch.testing.assert_close(model(ids), plain(ids), **TOL)
        got, want = model(ids, pad), plain(ids, pad)
        # The nested-tensor path leaves padded positions at 0; the regular path computes them.
        torch.testing.assert_close(got[~pad], want[~pad], **TOL)

    # 3. A plan with a tied embedding and head: converted together, still tied.
    plain = _TiedLM()
    model = bd.parallelize(copy.deepcopy(plain), {"emb": "vocab", "mlp.0": "column", "mlp.2": "row", "head": "head"})
    assert model.head.weight is model.emb.weight
    with torch.no_grad():
        logits = comm.all_gather_dim(model(ids % 11), -1, ctx.tp_group, model.head.partition_sizes)
        torch.testing.assert_close(logits, plain(ids % 11), **TOL)
    return True


@pytest.mark.parametrize("tp", [2, 3])
def test_converted_models_compute_what_the_plain_ones_did(tp):
    assert run_ranks(_convert_and_compare, tp, tp, timeout=120) == [True] * tp


def _checkpoint_round_trip(root):
    """parallelize -> train a step -> save -> export: the plain twin loads it; a dense state dict
    loads back into a differently initialised sharded model."""
    ctx = bd.init_parallel(tp=2)
    ids = _ids()
    torch.manual_seed(0)
    model = bd.parallelize(_Encoder())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids).square().mean().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        expected = model(ids)
    bd.save_checkpoint(f"{root}/ckpt", model, opt)
    if ctx.rank == 0:
        bd.export_dense(f"{root}/ckpt", f"{root}/dense.safetensors")
    torch.distributed.barrier()

    torch.manual_seed(1)
    other = bd.parallelize(_Encoder()).eval()
    bd.load_dense_state_dict(other, f"{root}/dense.safetensors")
    with torch.no_grad():
        assert torch.equal(other(ids), expected)  # same shards, same layout: bit-identical
    return expected


def test_parallelized_model_exports_to_its_plain_twin_and_imports_back(tmp_path):
    from safetensors.torch import load_file

    expected = run_ranks(_checkpoint_round_trip, 2, str(tmp_path), timeout=120)[0]
    torch.manual_seed(2)
    twin = _Encoder().eval()
    twin.load_state_dict(load_file(tmp_path / "dense.safetensors"))  # strict: exactly the plain names
    with torch.no_grad():
        torch.testing.assert_close(twin(_ids()), expected, **TOL)


def _ids():
    return torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(3))


def test_plan_errors_name_the_module_and_the_problem():
    plain = _Encoder()
    with pytest.raises(ValueError, match=r"pattern 'encoder.layer.\*.linear1' matches no module"):
        bd.parallelize(copy.deepcopy(plain), {"encoder.layer.*.linear1": "column"})
    with pytest.raises(ValueError, match=r"layers.0.self_attn.out_proj.*MultiheadAttention's output projection"):
        bd.parallelize(copy.deepcopy(plain), {"encoder.layers.0.self_attn.out_proj": "row"})
    with pytest.raises(TypeError, match=r"'emb' is a Embedding; style 'column' converts an Linear"):
        bd.parallelize(copy.deepcopy(plain), {"emb": "column"})
    with pytest.raises(ValueError, match=r"styles are"):
        bd.parallelize(copy.deepcopy(plain), {"emb": "rows"})
    with pytest.raises(ValueError, match=r"emb.weight is shared with \['head'\]"):
        bd.parallelize(_TiedLM(), {"emb": "vocab"})
    assert bd.plan_parallelism(_TiedLM()) == {"mlp.0": "column", "mlp.2": "row"}  # tied embedding left alone
