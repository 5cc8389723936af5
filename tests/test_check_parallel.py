"""`check_parallel` names the module at fault: a mistake planted in a column layer (a fused
``[gate; up]`` split as one block) is named there, not at the row layer where the numbers first
show it; one planted in the row layer (split in packed blocks its input does not come in) is named
there; a right plan has no module that disagrees, the column layers' split outputs and the row
layer's split input included (gathered by their own splits). At tp=2 and tp=3 (96 hidden features:
even at both; 97 vocabulary rows: uneven at both).

Tolerance: check_parallel's own, rtol 1e-4 of each value's magnitude (the TP sums reorder fp32
additions, about 1e-7 relative each; a wrong slice moves values by order 1).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.testing import run_ranks
from bigdense.testing.check import compare_on_this_rank, merge

VOCAB, D, HIDDEN = 97, 16, 48
RTOL = 1e-4
RIGHT = {"embed": "vocab", "gate_up": ("column", {"packed": 2}), "down": "row"}
PLANS = {
    "right": RIGHT,
    "gate_up": {**RIGHT, "gate_up": "column"},  # one block: rank 0 holds all of gate, none of up
    "down": {**RIGHT, "down": ("row", {"packed": 2})},  # two blocks: not the contiguous slice it is handed
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.gate_up = nn.Linear(D, 2 * HIDDEN, bias=False)  # [gate; up] in one projection
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _compare_every_plan(tp):
    bd.init_parallel(tp=tp)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    return {name: compare_on_this_rank(Block, ids, steps=0, plan=plan) for name, plan in PLANS.items()}


@pytest.mark.parametrize("tp", [2, 3])
def test_the_first_module_named_is_the_one_at_fault(tp):
    per_rank = run_ranks(_compare_every_plan, tp, tp, timeout=120)
    results = {name: merge(tp, [r[name] for r in per_rank], RTOL) for name in PLANS}
    assert results["right"].exact and results["right"].first_mismatch is None, results["right"].describe()
    compared = [m.label for m in per_rank[0]["right"].modules]
    assert compared == ["embed", "gate_up", "down (input)", "down"], compared  # the split ones gathered
    for planted in ("gate_up", "down"):
        result = results[planted]
        assert not result.exact and result.first_mismatch == planted, result.describe()
