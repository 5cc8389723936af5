"""Sequence parallelism, as in docs/sequence-parallelism.md, runnable as written.

    .venv/bin/python examples/sequence_parallel.py                                       # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/sequence_parallel.py     # tp=2, sequence split in 2

Activations of shape (B, S, d) = (2, 64, 1024) are split along S between the TP regions: each rank
holds 32 of the 64 positions there. The point shows at long sequences (S = 8192, d = 8192: 128 MiB
per sequence per activation in bf16, 1/tp of it per rank); these sizes run in seconds.
"""
import os

import torch

import bigdense as bd
from bigdense.models import GPT, GPTConfig

ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)  # the same on every rank
torch.set_default_device(ctx.device)
B, S, VOCAB = 2, 64, 1_000
x = bd.scatter_to_sequence(torch.randn(B, S, 1024), ctx.tp_group)  # this rank's share of the sequence

fc1 = bd.ColumnParallelLinear(1024, 4096, sequence_parallel=True)   # x (*, S_local, 1024) -> (*, S, 4096/tp)
fc2 = bd.RowParallelLinear(4096, 1024, sequence_parallel=True)      # (*, S, 4096/tp) -> (*, S_local, 1024)
mlp = bd.ParallelMLP(1024, 4096, sequence_parallel=True)            # (*, S_local, d) -> (*, S_local, d)
emb = bd.VocabParallelEmbedding(50_257, 1024, sequence_parallel=True)  # ids (*, S) -> (*, S_local, d)
ln  = bd.LayerNorm(1024, sequence_parallel=True)                    # also bd.RMSNorm
y = mlp(ln(x), seq_len=S)            # seq_len: the full length; omitted, the ranks exchange theirs
h = fc2(fc1(x, seq_len=S))  # a column -> row pair: the sequence gathered, then scattered again

idx = torch.randint(0, VOCAB, (B, S))
targets = torch.roll(idx, -1, dims=1)
model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=S, sequence_parallel=True))  # parallel.sequence_parallel=true
with bd.count_collectives() as counts:
    model(idx, targets).backward()
counts.by_kind                       # {"all_gather": (calls, bytes), "reduce_scatter": (...), ...}

if ctx.is_main:
    print(f"tp={ctx.tp_size}: activations {tuple(x.shape)} of ({B}, {S}, 1024) on this rank; MLP out {tuple(y.shape)}; "
          f"collectives of one GPT step: { {k: v[0] for k, v in counts.by_kind.items()} }")
bd.destroy_parallel()
