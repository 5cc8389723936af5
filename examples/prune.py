"""Pruning, as in docs/pruning.md, runnable as written.

    .venv/bin/python examples/prune.py                                       # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/prune.py     # the layers and their masks sharded, tp=2

A 256 -> 1024 -> 256 MLP pruned to 90% by one global magnitude threshold, trained a few steps with
its zeros intact, saved and loaded back; a row-parallel layer pruned 2:4; a SwiGLU MLP losing half
its hidden units. The masks and the printed counts are the same at tp=1 and tp=2. Files go to
outputs/example_prune (or the directory given as the first argument).
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import bigdense as bd

out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/example_prune")
ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)  # the same on every rank: shards of one TP-invariant initialisation
x, target = torch.randn(32, 256), torch.randn(32, 256)

mlp = bd.ParallelMLP(d_model=256, d_hidden=1024, activation="gelu", init="trunc_normal")  # one scale for both
report = bd.prune(mlp, 0.9)  # one threshold over up and down together, found without gathering them
optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-3, weight_decay=0.1)
for step in range(10):
    loss = F.mse_loss(mlp(x), target)
    loss.backward()  # pruned entries get a zero gradient (a hook multiplies it by the mask)
    bd.clip_grad_norm_(mlp, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    bd.apply_masks(mlp)  # pruned weights back to zero: AdamW's weight decay and moments would move them
zeros = sum(int((layer.weight == 0).sum()) for layer in (mlp.up, mlp.down))

bd.save_checkpoint(out / "pruned", mlp)
loaded = bd.ParallelMLP(d_model=256, d_hidden=1024, activation="gelu", init="trunc_normal")
bd.load_checkpoint(out / "pruned", loaded)  # the layers saved with a mask get theirs back
dense = loaded.to_dense()  # plain PyTorch, the pruned weights zero
export_error = (dense(x) - mlp(x)).abs().max().item()  # (mlp(x) is a collective: on every rank)

row = bd.RowParallelLinear(1024, 256)
bd.prune(row, None, "n:m", n=2, m=4)  # 2 of every 4 weights along the input dimension

swiglu = bd.ParallelMLP(d_model=256, d_hidden=1024, activation="swiglu")
shrunk = bd.prune(swiglu, 0.5, "rows")  # half the hidden units go: gate, up and down shrink to 512

if ctx.is_main:
    print(report)
    print(f"tp={ctx.tp_size}: {zeros:,} zeros on this rank after 10 steps (loss {loss.item():.4f}); loaded "
          f"masks equal: {torch.equal(loaded.up.weight_mask, mlp.up.weight_mask)}; the dense export's output "
          f"differs by {export_error:.1e}; 2:4 row layer keeps "
          f"{row.weight_mask.float().mean().item():.0%}; rows: d_hidden {shrunk.new_sizes['ParallelMLP']}")
bd.destroy_parallel()
