"""Muon on the dense layers of your own model through bigdense's engine, as in docs/training.md.

    .venv/bin/python examples/muon.py                                        # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/muon.py      # tp=2: each matrix whole on one rank

The reference GPT (SwiGLU, tied embeddings), a few steps on random tokens with Muon for its
projections and AdamW for the embeddings and norms; the optimizer says which matrices each rank
orthogonalises and how many bytes it sends per step to move them.
"""
import os

import torch

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.models import GPT, GPTConfig

ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, activation="swiglu", bias=False),
            tp_group=ctx.tp_group)
engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"),
                         optim_cfg=OptimConfig(name="muon", lr=2e-3, warmup_steps=2),  # conf/optim/muon.yaml's options
                         precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=4, max_steps=5)
muon = engine.optimizer  # Muon for the projections, AdamW inside for the rest
ids = torch.randint(0, 512, (4, 65))
for step in range(5):
    result = engine.train_step([(ids[:, :-1], ids[:, 1:])])
owned = [muon.exchange.matrices[m].name for m in muon.exchange.assignment.owned_by(ctx.rank)]
print(f"tp={ctx.tp_size}: loss {result.loss:.3f}; rank {ctx.rank} orthogonalises {len(owned)} of "
      f"{len(muon.exchange.matrices)} matrices and sends {muon.exchange.bytes_sent(ctx.rank, muon.ns_dtype.itemsize):,} "
      f"bytes per step")
bd.destroy_parallel()
