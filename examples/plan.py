"""Memory planning, as in docs/memory-planner.md, runnable as written (one process, no
process group: the model is built on the meta device, so nothing is allocated).

    .venv/bin/python examples/plan.py

A 12-layer, 768-wide GPT with a 32k vocabulary (GPT-2 small's shape) planned for tp=4 x dp=2 in
bf16; the printed bytes per rank are what each of the 8 ranks would hold.
"""
import torch

import bigdense as bd
from bigdense.models import GPT, GPTConfig

with torch.device("meta"):
    model = GPT(GPTConfig(vocab_size=32_768, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024))
est = bd.plan.estimate(model, plan=None, tp=4, dp=2, precision="bf16", micro_batch_size=8, seq_len=1024)
est.total_params, est.params_per_rank, est.bytes_per_rank   # {"params", "grads", "optimizer", ...}
print(f"tp=4 x dp=2: {est.total_params / 1e6:.1f}M parameters, {est.params_per_rank / 1e6:.1f}M per rank; "
      + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in est.bytes_per_rank.items()))
