"""Low-rank compression of a layer, as in docs/compression.md, runnable as written.

    .venv/bin/python examples/low_rank.py                                       # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/low_rank.py     # the layer and its SVD sharded, tp=2

A 1024 -> 4096 column-parallel layer (a transformer MLP's up-projection) replaced by a rank-256
pair: 1024*256 + 256*4096 weights instead of 1024*4096 (31% of them). Its weight here is random, so
the error printed is large; a trained weight's spectrum falls off, which is what makes this pay.
"""
import os

import torch

import bigdense as bd

ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)  # the same on every rank: the layer's shards and the SVD's sketch agree
torch.set_default_device(ctx.device)
layer = bd.ColumnParallelLinear(1024, 4096, gather_output=True)
x = torch.randn(32, 1024)

pair = bd.low_rank(layer, rank=256)  # or energy=0.9; nn.Linear, ColumnParallelLinear, RowParallelLinear
y = pair(x)  # nn.Sequential(first, second): in -> r -> out, bias on second

error = (y - layer(x)).norm() / layer(x).norm()
if ctx.is_main:
    print(f"tp={ctx.tp_size}: rank {pair.rank} pair, {sum(p.numel() for p in pair.parameters())} parameters on this "
          f"rank (the layer: {sum(p.numel() for p in layer.parameters())}); relative output error {error:.3f}")
bd.destroy_parallel()
