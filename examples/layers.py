"""The layers of bigdense, as in the README and docs/layers.md, runnable as written.

    .venv/bin/python examples/layers.py                                        # one process, unsharded
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/layers.py      # tp=2 on 2 CPU processes

The sizes here run in seconds on a laptop. The comments give the sizes that show the point of each
layer; those need one GPU (or a few GB of RAM) per rank.
"""
import os

import torch
import torch.nn.functional as F

import bigdense as bd

ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))  # every process in one TP group; alone: tp=1
torch.manual_seed(0)  # the same seed on every rank: shards of one TP-invariant initialisation
torch.set_default_device(ctx.device)  # CPU under gloo, this rank's GPU under NCCL

D_MODEL, D_HIDDEN = 64, 256  # a transformer MLP: 1024 -> 4096 (or 8192 -> 28672) shows the memory split
VOCAB = 1_000                # a language model's vocabulary: 50_257 (GPT-2), 128_256 (Llama 3)
CLASSES = 10_000             # the point of the head: 1_000_000 classes x 1024 is 4 GB of fp32 weight
                             # (8 GB with its gradient, 16 GB with Adam) in ONE process; over tp ranks
                             # each holds 1/tp of it, and 4,096 tokens never form the 16 GB of logits
TOKENS = 32

x = torch.randn(TOKENS, D_MODEL)  # the same on every TP rank (same seed)
fc1 = bd.ColumnParallelLinear(D_MODEL, D_HIDDEN)  # local weight (D_HIDDEN/tp, D_MODEL); output sharded on the last dim
fc2 = bd.RowParallelLinear(D_HIDDEN, D_MODEL)  # local weight (D_MODEL, D_HIDDEN/tp); input sharded; output all-reduced
y = fc2(F.gelu(fc1(x)))  # (TOKENS, D_MODEL) on every rank
dense1, dense2 = fc1.to_dense(), fc2.to_dense()  # nn.Linear with the full weights (a collective)
torch.testing.assert_close(y, dense2(F.gelu(dense1(x))), rtol=1e-5, atol=1e-5)  # the unsharded layers agree

mlp = bd.ParallelMLP(d_model=D_MODEL, d_hidden=D_HIDDEN, activation="swiglu", dropout=0.1)
emb = bd.VocabParallelEmbedding(num_embeddings=VOCAB, embedding_dim=D_MODEL)
head = bd.ParallelClassifierHead(D_MODEL, num_classes=CLASSES, bias=False)

ids = torch.randint(0, VOCAB, (TOKENS,))
target = torch.randint(0, CLASSES, (TOKENS,))
target[:4] = -100  # ignored positions (padding)
h = mlp(emb(ids))
loss = head.loss(h, target, label_smoothing=0.1, ignore_index=-100)  # never gathers the logits
loss.backward()
scores, classes = head.predict(h, k=5)  # global top-5, the same on every rank

with bd.collect_loss_metrics() as seen:
    loss = head.loss(h, target, z_loss=1e-4)
accuracy = seen.correct / seen.tokens  # device scalars, summed over the calls inside the block

if ctx.is_main:
    print(f"tp={ctx.tp_size}: MLP output {tuple(y.shape)}; head weight on this rank {tuple(head.weight.shape)} "
          f"of ({CLASSES}, {D_MODEL}); loss {loss.item():.4f}; top-5 classes of token 0: {classes[0].tolist()}; "
          f"token accuracy {accuracy.item():.3f}")
bd.destroy_parallel()
