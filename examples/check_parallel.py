"""Is my own model exact once `bd.parallelize` converts it? Ask on CPU before spending GPU hours.

    .venv/bin/python examples/check_parallel.py        # starts its own CPU ranks: 2, then 3

A small transformer block written in plain PyTorch (attention with per-head norms, a SwiGLU MLP
with a fused [gate; up] projection, a tied embedding and head), converted by a plan, and compared
by `bigdense.testing.check_parallel` with the unconverted model: forward, backward, an optimizer
step, at tp=2 and tp=3. Then the same plan with one mistake, ``[gate; up]`` split as one block
(rank 0 would hold all of gate and none of up), and the check names the module at fault, ``gate_up``,
although the numbers first differ after ``down``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from bigdense.testing import check_parallel

VOCAB, D, HEADS, HIDDEN = 97, 48, 6, 96  # 6 heads: whole heads on every rank at tp 2 and 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_norm = nn.RMSNorm(D // HEADS)  # one weight for every head: sees this rank's heads only
        self.o = nn.Linear(D, D, bias=False)
        self.gate_up = nn.Linear(D, 2 * HIDDEN, bias=False)  # [gate; up] in one projection
        self.down = nn.Linear(HIDDEN, D, bias=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, ids):
        x = self.embed(ids)
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, D // HEADS)).transpose(1, 2).unbind(-2)  # (B, heads, S, d)
        attn = F.scaled_dot_product_attention(self.q_norm(q), k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).flatten(-2))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.lm_head(x)


plan = {
    "embed": "vocab", "lm_head": ("column", {"gather_output": True}),  # one split of the tied weight
    "qkv": "column", "q_norm": "partial_grad", "o": "row",  # q, k, v interleaved per head: whole heads
    "gate_up": ("column", {"packed": 2}), "down": "row",  # each half of [gate; up] split on its own
}
ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
report = check_parallel(Block, ids, tp=(2, 3), steps=1, plan=plan)  # prints a line per TP size
assert report.exact

wrong = check_parallel(Block, ids, tp=2, plan={**plan, "gate_up": "column"}, verbose=False)
print(wrong)  # DIFFERS ... first module that disagrees: gate_up
assert not wrong.exact and wrong.results[2].first_mismatch == "gate_up"
