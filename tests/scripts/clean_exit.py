"""Collectives, then `bd.destroy_parallel`, then a normal interpreter exit, with the groups still held
by a layer and the context (as every example and launch script leaves them). Run by test_context."""
import torch

import bigdense as bd

ctx = bd.init_parallel(tp=2)
layer = bd.ColumnParallelLinear(8, 16, gather_output=True)  # holds the TP group past destroy_parallel
for _ in range(3):
    layer(torch.randn(4, 8)).sum().backward()  # collectives on temporaries the workers free later
bd.destroy_parallel()
