"""Checkpoints and plain-PyTorch interop, as in docs/checkpoints.md, runnable as written.

    .venv/bin/python examples/checkpoints.py                                     # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/checkpoints.py   # tp=2

A plain PyTorch model is converted with `bd.parallelize`, trained a few steps, saved sharded
(once synchronously, once in the background), loaded back, exported as one plain safetensors file and loaded into the unconverted model. Files go
to outputs/example_checkpoints (or the directory given as the first argument). The sizes run in
seconds; a model whose embedding and MLPs need sharding (50k x 4096, 4096 -> 16384) goes the same way.
"""
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
import torch.nn as nn

import bigdense as bd

VOCAB, D_MODEL, D_HIDDEN = 1_000, 64, 256


class PlainLM(nn.Module):
    """An ordinary PyTorch model: token embedding, an MLP, an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_MODEL))
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, ids):
        h = self.tok_emb(ids)
        return h + self.mlp(h)


out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/example_checkpoints")
ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)  # the same plain weights on every rank: each keeps its own slices
plain_model = PlainLM().to(ctx.device)
reference = {k: v.clone() for k, v in plain_model.state_dict().items()}

# nn.Linear / nn.Embedding -> bigdense layers, in place (module names kept); the tied pair stays tied.
plan = {"tok_emb": "vocab", "mlp.0": "column", "mlp.2": "row", "head": "head"}  # names -> styles ("*" globs)
model = bd.parallelize(PlainLM().to(ctx.device), plan)
bd.load_dense_state_dict(model, reference)  # start TP training from a dense model's weights
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def train_steps(n):
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (8, 16), device=ctx.device)
        loss = model.head.loss(model(ids)[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step(), sched.step(), optimizer.zero_grad()


train_steps(3)
bd.save_checkpoint(out / "step_3", model, optimizer, scheduler=sched, extra={"data_pos": 3}, step=3, keep_last=3)
train_steps(1)
handle = bd.save_checkpoint(out / "step_4", model, optimizer, scheduler=sched, extra={"data_pos": 4}, step=4,
                            async_=True)  # returns after a host snapshot of what this rank writes
handle.done(); handle.wait()  # wait() re-raises a failure
bd.wait_for_checkpoints()  # waits for the save in flight (bd.destroy_parallel too)
info = bd.load_checkpoint(out / "latest", model, optimizer, scheduler=sched)  # any tp / dp
pos = info.extra["data_pos"]

probe = torch.arange(16, device=ctx.device).view(1, 16)
sharded_out = model(probe)  # a collective: every rank computes it
if ctx.is_main:  # offline, one process, no process group
    bd.export_dense(out / "latest", out / "model.safetensors")  # one file, plain nn.Module names
    plain_model = PlainLM().to(ctx.device)
    safetensors.torch.load_model(plain_model, out / "model.safetensors")  # the tied head is stored once
    torch.testing.assert_close(plain_model(probe), sharded_out, rtol=1e-5, atol=1e-5)  # the same trained model
    print(f"tp={ctx.tp_size}: saved and loaded at step {info.step} (data_pos {pos}); exported "
          f"{(out / 'model.safetensors').stat().st_size / 1e3:.0f} kB; the plain model computes what the "
          f"sharded one does")
bd.destroy_parallel()
