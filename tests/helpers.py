"""What the tests share: comparison helpers, paths, the small models several test files train
(`TinyNet`), and shard-spec collection. Test files import from here, never from each other."""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # torchrun, deepspeed, accelerate of the running environment
TRAIN = str(ROOT / "launch" / "train.py")


def assert_close(actual, expected, what, *, rtol, atol):
    """torch.testing.assert_close with the name of the quantity in the message."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def shard_specs(module) -> dict:
    """``{parameter path: ShardSpec}`` of every bigdense layer in ``module``, from the layers' reports."""
    specs = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "bd_shard_specs"):
            for name, spec in sub.bd_shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


# ---- TinyNet: a stack of transformer-shaped blocks built only from foundation layers: ``attn``
# (column -> GELU -> dropout on the *sharded* hidden units -> row) and ``mlp`` (column -> GELU ->
# row -> dropout on the *replicated* output), each behind a LayerNorm with a residual; the loss is
# the MSE against a target. Used by the recompute, precision and engine tests.

class Mixer(nn.Module):
    """Attention stand-in: dropout inside the TP region, on this rank's slice of the hidden units."""

    def __init__(self, d, h, p):
        super().__init__()
        self.up, self.down, self.p, self.h = bd.ColumnParallelLinear(d, h), bd.RowParallelLinear(h, d), p, h

    def forward(self, x):
        a = F.gelu(self.up(x))
        a = bd.tp_dropout(a, self.p, self.training, shard_dim=-1, global_size=self.h, offset=self.up.partition_start)
        return self.down(a)


class MLP(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.up, self.down, self.p = bd.ColumnParallelLinear(d, h), bd.RowParallelLinear(h, d), p

    def forward(self, x):
        return bd.tp_dropout(self.down(F.gelu(self.up(x))), self.p, self.training)


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Mixer(d, h, p)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, h, p)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyNet(nn.Module):
    def __init__(self, d=16, h=24, n_blocks=4, p=0.2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, p) for _ in range(n_blocks))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)
