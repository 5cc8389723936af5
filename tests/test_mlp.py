"""ParallelMLP against a plain PyTorch MLP written here, at tp = 1..4; one all-reduce each way (counted by
`bd.count_collectives`); TP-invariant dropout."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.layers.mlp import DenseMLP
from bigdense.testing import run_ranks
from helpers import assert_close

D_MODEL = 6
# fp32: the row-parallel projection sums per-rank partial products over TP, and the column
# projections' input gradient is summed over TP: summation order only, a few ulps of O(1) values.
FP32 = dict(rtol=1e-5, atol=1e-6)


class PlainMLP(torch.nn.Module):
    """The reference, written here: ``down(act(up(x)))`` or ``down(silu(gate(x)) * up(x))`` with
    torch's own functions (nothing shared with bigdense's activation table)."""

    def __init__(self, d, hidden, activation, bias):
        super().__init__()
        self.activation = activation
        self.gate = torch.nn.Linear(d, hidden, bias=bias) if activation == "swiglu" else None
        self.up, self.down = torch.nn.Linear(d, hidden, bias=bias), torch.nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        if self.activation == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)) if self.activation == "gelu" else torch.relu(self.up(x)))


def _mlp_matches_reference(tp):
    bd.init_parallel(tp=tp)
    cases = list(itertools.product(("gelu", "relu", "swiglu"), (True, False), (12, 10)))  # hidden 10: uneven at tp 3, 4
    for i, (activation, bias, hidden) in enumerate(cases):
        torch.manual_seed(i)
        ref = PlainMLP(D_MODEL, hidden, activation, bias)
        linears = (ref.gate, ref.up, ref.down) if activation == "swiglu" else (ref.up, ref.down)
        # Both ways in: the linears themselves, or the module.
        mlp = bd.ParallelMLP.from_dense(*linears, activation=activation) if i % 2 else bd.ParallelMLP.from_dense(ref)
        assert mlp.activation == activation and (mlp.gate is None) == (activation != "swiglu")
        if activation == "swiglu":  # gate and up split alike, so each rank's columns pair up
            assert mlp.gate.partition_sizes == mlp.up.partition_sizes == mlp.down.partition_sizes
        x = torch.randn(*((2, 3) if i % 3 else (4,)), D_MODEL, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        upstream = torch.randn(*x.shape)
        what = f"tp={tp} {activation} bias={bias} hidden={hidden}"

        with bd.count_collectives() as forward:
            y = mlp(x)
        with bd.count_collectives() as backward:
            (y * upstream).sum().backward()
        expected = {"all_reduce": (1, x.numel() * 4)} if tp > 1 else {}  # one all-reduce of (*, d) each way
        assert forward.by_kind == expected and backward.by_kind == expected, (what, forward.by_kind, backward.by_kind)

        y_ref = ref(x_ref)
        (y_ref * upstream).sum().backward()
        assert_close(y, y_ref, f"{what} output", **FP32)
        assert_close(x.grad, x_ref.grad, f"{what} input grad", **FP32)
        for name in ("gate", "up", "down") if activation == "swiglu" else ("up", "down"):
            ours, theirs = getattr(mlp, name), getattr(ref, name)
            for param in ("weight", "bias") if bias else ("weight",):
                spec = ours.shard_spec(param)
                full = getattr(theirs, param).grad
                expected = full if spec is None else spec.slice_of(full)
                assert_close(getattr(ours, param).grad, expected, f"{what} {name}.{param} grad", **FP32)

        dense = mlp.to_dense()
        assert type(dense) is DenseMLP
        theirs = ref.state_dict()
        assert dense.state_dict().keys() == theirs.keys()
        assert all(torch.equal(v, theirs[k]) for k, v in dense.state_dict().items())
    named = rf"ParallelMLP\(d_model=6, d_hidden=10, activation='swiglu', tp={tp}.*expected input of shape \(\*, 6\)"
    with pytest.raises(ValueError, match=named):
        mlp(torch.randn(2, 5))
    return y.tolist()


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_mlp_matches_the_plain_mlp(tp):
    results = [_mlp_matches_reference(1)] if tp == 1 else run_ranks(_mlp_matches_reference, tp, tp)
    assert all(r == results[0] for r in results)  # replicated output, bit-identical across ranks


def _dropout_output(tp, activation):
    bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    mlp = bd.ParallelMLP(D_MODEL, 10, activation, dropout=0.3)
    x = torch.randn(8, D_MODEL)
    torch.manual_seed(1)  # the dropout seed is drawn from the default generator at each call
    dropped = mlp(x)
    mlp.eval()
    return dropped.detach(), mlp(x).detach()


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dropout_mask_does_not_depend_on_tp(activation):
    single_dropped, single_eval = _dropout_output(1, activation)
    assert bd.get_default_context().tp_size == 1
    zeros = single_dropped == 0
    # 48 outputs at p=0.3: some but not all dropped; the survivors are scaled by 1/(1-p).
    assert 0 < zeros.sum() < zeros.numel()
    assert_close(single_dropped[~zeros], single_eval[~zeros] / 0.7, "inverted dropout scaling", **FP32)
    for dropped, evaluated in run_ranks(_dropout_output, 2, 2, activation):
        assert torch.equal(dropped == 0, zeros)  # the same mask at tp=1 and on every rank at tp=2
        assert_close(dropped, single_dropped, "dropped output tp=2 vs tp=1", **FP32)
        assert_close(evaluated, single_eval, "eval output tp=2 vs tp=1", **FP32)


def _gather_fresh(tp, activation):
    bd.init_parallel(tp=tp)
    torch.manual_seed(9)
    mlp = bd.ParallelMLP(D_MODEL, 10, activation)
    specs = {f"{n}.{p}": s for n, m in mlp.named_children() for p, s in m.bd_shard_specs().items()}
    return sorted(specs), [p.detach() for p in mlp.to_dense().parameters()]


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_init_is_tp_invariant_and_meta_materialises_the_same(activation):
    torch.manual_seed(9)
    single = [p.detach() for p in bd.ParallelMLP(D_MODEL, 10, activation).to_dense().parameters()]
    for names, full in run_ranks(_gather_fresh, 3, 3, activation):
        sharded = ["up.bias", "up.weight", "down.weight"]
        sharded += ["gate.bias", "gate.weight"] if activation == "swiglu" else []
        assert names == sorted(sharded)  # every sharded parameter declared; down.bias is replicated
        assert all(torch.equal(a, b) for a, b in zip(full, single))
    torch.manual_seed(9)
    meta = bd.materialize(bd.ParallelMLP(D_MODEL, 10, activation, device="meta"))
    assert all(torch.equal(a, b) for a, b in zip(meta.to_dense().parameters(), single))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="activation must be one of"):
        bd.ParallelMLP(4, 8, "tanh")
    with pytest.raises(TypeError, match=r"expected 3 nn.Linear \(gate, up, down\)"):
        bd.ParallelMLP.from_dense(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), activation="swiglu")
    with pytest.raises(ValueError, match=r"output projection must be \(4, 8\)"):
        bd.ParallelMLP.from_dense(torch.nn.Linear(4, 8), torch.nn.Linear(8, 5))
