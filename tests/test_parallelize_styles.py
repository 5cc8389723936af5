"""Every plan style of `bd.parallelize` on a small plain model written here, converted by a plan that
names it, checked by `bigdense.testing.check_parallel` against the unconverted model at tp=2 and
tp=3 (uneven splits): outputs before and after an SGD step, every gradient (each rank's shard
against the same slice of the plain one).

Each model isolates one style: the modules around it are plain or converted by the styles the
others test. Tolerance: check_parallel's, rtol 1e-4 of each value's magnitude (the TP sums reorder
fp32 additions; a wrong slice or a missing sum moves values by order 1). Splits a TP size does not
allow (units that do not divide, fewer experts than ranks) are refused before anything changes.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.parallelize.plans import plan_conversion
from bigdense.testing import check_parallel, run_ranks

D, H, V, E = 8, 24, 11, 3  # width, hidden (6 heads of 4: whole heads at tp 2 and 3), vocabulary, experts
E2, I2 = 5, 6  # routed experts (3 + 2 at tp=2, 2 + 2 + 1 at tp=3) and their hidden width


class ScaledEmbedding(nn.Embedding):
    """An embedding subclass with its own forward (as Gemma's scaled word embedding)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class NormedEmbedding(nn.Embedding):
    """A lookup followed by a norm with parameters of its own, in one module (as Inkling's)."""

    def __init__(self):
        super().__init__(V, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, ids):
        return self.norm(super().forward(ids))


class ScaledHead(nn.Linear):
    """A linear subclass with a learned per-output scale (as Dory's LM head)."""

    def __init__(self):
        super().__init__(D, V, bias=False)
        self.logit_scale = nn.Parameter(torch.rand(V) + 0.5)

    def forward(self, x):
        return super().forward(x) * self.logit_scale


class Experts(nn.Module):
    """Grouped expert weights, (E, 2H, D) packed [gate; up] and (E, D, H), as Mixtral's, and an
    identity expert inside (as LongCat-Flash's zero-compute experts)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * H, D) / 3)
        self.down_proj = nn.Parameter(torch.randn(E, D, H) / 3)
        self.identity = nn.Identity()

    def forward(self, x, index, weights):
        out = self.identity(x) * 0.5
        for k in range(index.shape[-1]):
            for e in range(E):
                hit = index[:, k] == e
                gate, up = F.linear(x[hit], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[hit] += F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[hit, k, None]
        return out


class PerExpertScale(nn.Module):
    """A parameter of one row per expert in a child of the experts (as a per-expert norm's weight)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(E2, D) + 0.5)


class RoutedExperts(nn.Module):
    """Experts as transformers writes them (Mixtral's): ``num_experts`` of them in (experts, ...)
    weights, called with hidden states, expert indices and routing weights; an index of
    ``num_experts`` is no expert (expert parallelism's mark for another rank's)."""

    def __init__(self):
        super().__init__()
        self.num_experts = E2
        self.gate_up_proj = nn.Parameter(torch.randn(E2, 2 * I2, D) / 3)
        self.down_proj = nn.Parameter(torch.randn(E2, D, I2) / 3)
        self.scale = PerExpertScale()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * self.scale.weight[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class Model(nn.Module):
    config = SimpleNamespace(head_dim=4)  # what Hugging Face's unit styles read: the width of a head (`head_norm`'s)

    def __init__(self):
        super().__init__()
        self.emb = ScaledEmbedding(V, D, padding_idx=0)  # at tp=2, global row 6 is rank 1's local row 0
        self.normed = NormedEmbedding()
        self.wide = nn.Embedding(V, D)  # embedding_dim
        self.up = nn.Linear(D, H)
        self.head_norm = nn.LayerNorm(4)  # per-head norm between column and row: partial_grad
        self.down = nn.Linear(H, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.router2 = nn.Linear(D, E2, bias=False)
        self.routed = RoutedExperts()
        self.token_norm = nn.LayerNorm(D)  # runs on this rank's share of the sequence: sequence
        self.kv_a = nn.Linear(D, 6)  # [latent 4 | rope 2]: mla_kv_a
        self.kv_b = nn.Linear(4, H)
        self.out = nn.Linear(H, D)
        self.packed = nn.Linear(D, 2 * H)  # a fused [gate; up] Linear: column packed 2
        self.packed_down = nn.Linear(H, D)
        self.head = ScaledHead()

    def forward(self, ids):
        x = self.emb(ids) + self.normed(ids) + self.wide(ids)
        h = self.up(x)
        h = self.head_norm(h.unflatten(-1, (-1, 4))).flatten(-2)  # whole heads of 4 on each rank
        x = x + self.down(F.gelu(h))
        flat = x.reshape(-1, D)
        weights, index = torch.topk(self.router(flat).softmax(-1), 2)
        x = x + self.experts(flat, index, weights).view_as(x)
        weights, index = torch.topk(self.router2(x.reshape(-1, D)).softmax(-1), 2)
        x = x + self.routed(x.reshape(-1, D), index, weights).view_as(x)
        x = self.token_norm(x)
        latent, rope = self.kv_a(x).split([4, 2], dim=-1)
        kv = self.kv_b(latent) * (1 + rope.sum(-1, keepdim=True))  # rope enters the TP region directly
        x = x + self.out(kv)
        gate, up = self.packed(x).chunk(2, dim=-1)
        x = x + self.packed_down(F.silu(gate) * up)
        return self.head(x)


PLAN = {
    "emb": "vocab", "normed": "vocab", "wide": "embedding_dim",
    # Hugging Face's unit styles: column and row split in whole heads, of the config's head_dim (4).
    "up": "unit_colwise", "head_norm": "partial_grad", "down": "unit_rowwise",
    "experts": "partial_output", "experts.gate_up_proj": ("column", {"packed": 2}), "experts.down_proj": "row",
    "experts.identity": "divide_input", "routed": "experts", "routed.scale.weight": "by_expert",
    "token_norm": "sequence",
    "kv_a": ("mla_kv_a", {"rope_dim": 2}), "kv_b": "column", "out": "row",
    "packed": ("column", {"packed": 2}), "packed_down": "row",
    "head": ("column", {"gather_output": True}),
}


def _batch():
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    ids[0, :3] = torch.tensor([0, 6, 10])  # the padding row, the first row of a rank, the last row
    return ids


def test_every_style_is_exact_against_the_plain_model_at_tp2_and_tp3():
    check = check_parallel(Model, _batch(), tp=(2, 3), steps=2, plan=PLAN, verbose=False)
    assert check.exact, str(check)
    assert len(check.results[3].grads) >= 2 * len(dict(Model().named_parameters()))  # every gradient, both steps


def test_check_parallel_names_the_first_module_that_disagrees():
    wrong = {**PLAN, "experts.gate_up_proj": "column"}  # a plain column split cuts [gate; up] in the middle
    check = check_parallel(Model, _batch(), tp=2, plan=wrong, verbose=False)
    assert not check.exact and check.results[2].first_mismatch == "experts", str(check)


def _report():
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = bd.parallelize(Model(), PLAN)
    report = model.bd_parallel_report
    # Subclasses, the experts and the norms are converted in place: same classes, same names.
    assert type(model.head).__name__ == "ScaledHead" and isinstance(model.head, nn.Linear)
    assert model.head.logit_scale.shape == (6 - bd.get_default_context().tp_rank,)  # 11 over 2, with the rows
    assert type(model.up).__name__ == "ColumnParallelLinear"  # a plain nn.Linear: bigdense's own layer
    assert sorted(model.state_dict()) == sorted(Model().state_dict())
    return report.converted, report.sharded_fraction


def test_the_report_says_what_was_converted_and_how():
    converted, fraction = run_ranks(_report, 2)[0]
    assert converted["experts.gate_up_proj"] == "column (packed 2)" and converted["head"] == "column (gathered)"
    assert converted["token_norm"] == "sequence" and 0.5 < fraction < 1.0
    assert converted["up"] == "column (units of 4)" and converted["down"] == "row (units of 4)"
    assert converted["routed"] == "experts (whole experts per rank)" and converted["routed.scale.weight"] == "by_expert"


@pytest.mark.parametrize("change, tp, message", [
    # 24 features are 3 units of 8: no two ranks hold the same number of whole units.
    ({"up": ("column", {"unit": 8})}, 2, r"'up': style 'column' splits its 24 out features in whole units of 8; "
                                         r"3 units do not give each of 2 ranks the same number"),
    ({"down": ("row", {"unit": 5})}, 2, r"'down': style 'row' splits its 24 in features in whole units of 5"),
    ({"routed": "experts"}, 6, r"'routed': 5 experts cannot give each of 6 ranks one"),  # 6 heads: whole at tp=6
    ({"routed": "partial_output"}, 2, r"'routed.scale.weight' is split by expert .* no module above it is converted "
                                      r"as 'experts'"),
    ({"routed.down_proj": ("column", {"unit": 2})}, 2, r"'routed.down_proj' is a parameter; only .* split"),
])
def test_splits_the_tp_size_does_not_allow_are_refused_with_what_and_why(change, tp, message):
    with pytest.raises(ValueError, match=message):
        plan_conversion(Model(), {**PLAN, **change}, tp)
