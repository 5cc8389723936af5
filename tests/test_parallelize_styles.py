"""Every plan style of `bd.parallelize` on a small plain model written here, converted by a plan that
names it, checked by `bigdense.testing.check_parallel` against the unconverted model at tp=2 and
tp=3 (uneven splits): outputs before and after an SGD step, every gradient (each rank's shard
against the same slice of the plain one).

Each model isolates one style: the modules around it are plain or converted by the styles the
others test. Tolerance: check_parallel's, rtol 1e-4 of each value's magnitude (the TP sums reorder
fp32 additions; a wrong slice or a missing sum moves values by order 1).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.testing import check_parallel, run_ranks

D, H, V, E = 8, 24, 11, 3  # width, hidden (6 heads of 4: whole heads at tp 2 and 3), vocabulary, experts


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


class Model(nn.Module):
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
        x = self.token_norm(x)
        latent, rope = self.kv_a(x).split([4, 2], dim=-1)
        kv = self.kv_b(latent) * (1 + rope.sum(-1, keepdim=True))  # rope enters the TP region directly
        x = x + self.out(kv)
        gate, up = self.packed(x).chunk(2, dim=-1)
        x = x + self.packed_down(F.silu(gate) * up)
        return self.head(x)


PLAN = {
    "emb": "vocab", "normed": "vocab", "wide": "embedding_dim",
    "up": "column", "head_norm": "partial_grad", "down": "row",
    "experts": "partial_output", "experts.gate_up_proj": ("column", {"packed": 2}), "experts.down_proj": "row",
    "experts.identity": "divide_input", "token_norm": "sequence",
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
