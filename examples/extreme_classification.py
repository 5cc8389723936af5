"""A Partial FC head, as in docs/heads.md, runnable as written.

    .venv/bin/python examples/extreme_classification.py                                   # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/extreme_classification.py  # tp=2
    .venv/bin/torchrun --standalone --nproc_per_node=4 examples/extreme_classification.py  # tp=2 x dp=2: world-sharded

The classes go over every rank of the TP x DP mesh; with no data parallelism (one process, or
tp=2 on two) the head runs as shard="tp" and says so in a warning. 100,000 classes x d=128 run in
seconds; Partial FC's own scale is millions of identities (3M x 512 is 6 GB of fp32 weight).
"""
import os
import warnings

import torch

import bigdense as bd

world = int(os.environ.get("WORLD_SIZE", 1))
ctx = bd.init_parallel(tp=min(world, 2))
torch.manual_seed(0)  # the same on every rank
warnings.simplefilter("ignore", UserWarning)  # (the one-process run's "runs as shard='tp'")
h = torch.randn(64, 128)                      # this DP rank's features
target = torch.randint(0, 100_000, (64,))
head = bd.ParallelClassifierHead(128, 100_000, bias=False, shard="world", sample_rate=0.1,
                                 margin="arcface", scale=64.0)
loss = head.loss(h, target)        # h, target: this DP rank's batch; the mean over its own tokens
scores, ids = head.predict(h, k=5) # ranks by cosine
loss.backward()

if ctx.is_main:
    print(f"tp={ctx.tp_size}: shard={head.shard!r} over {head.tp_size} rank(s), {head.classes_local} classes here; "
          f"loss {loss.item():.3f}; top-5 of token 0 {ids[0].tolist()}")
bd.destroy_parallel()
