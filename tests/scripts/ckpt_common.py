"""A tiny tensor-parallel language model, its data and its reference states, for the checkpoint tests.

Every sharded dimension is uneven at tp = 2, 3 and 4 (vocabulary 11, hidden 10 at tp 3/4), the
embedding and the head are tied, the MLP is SwiGLU (gate/up/down) with dropout, and a LayerNorm
is replicated: each kind of tensor a checkpoint must place.

`full_states` gathers global tensors with plain collectives (not with the checkpoint code), so the
tests compare the checkpoint against an independent reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import bigdense as bd
from bigdense.parallel import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for crash_train.py's subprocesses
from helpers import shard_specs  # noqa: E402

VOCAB, D_MODEL, D_HIDDEN = 11, 6, 10


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.emb = bd.VocabParallelEmbedding(VOCAB, D_MODEL)
        self.mlp = bd.ParallelMLP(D_MODEL, D_HIDDEN, "swiglu", dropout=dropout)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = bd.ParallelClassifierHead(D_MODEL, VOCAB)
        bd.tie_weights(self.emb, self.head)

    def forward(self, ids, target):
        h = self.emb(ids)
        h = h + self.mlp(h)
        return self.head.loss(self.norm(h), target)


def batch(pos: int, n: int = 8):
    """The batch at data position ``pos``: the same on every rank, a function of ``pos`` only."""
    g = torch.Generator().manual_seed(1000 + pos)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    return ids, (ids * 3 + 1) % VOCAB


def make_optimizer(model, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return opt, sched


def train_steps(model, opt, sched, start: int, stop: int, scaler=None) -> list[float]:
    """Steps ``start..stop-1`` (data position = step); returns the losses."""
    losses = []
    for step in range(start, stop):
        loss = model(*batch(step))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def local_states(model, opt=None) -> dict[str, torch.Tensor]:
    """This rank's tensors: ``model/<name>`` and ``optim/<param name>/<key>``."""
    out = {f"model/{n}": t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}
    if opt is not None:
        for name, p in model.named_parameters():
            for key, value in opt.state.get(p, {}).items():
                out[f"optim/{name}/{key}"] = value.detach().clone()
    return out


def full_states(model, opt=None, tp_group=None) -> dict[str, torch.Tensor]:
    """Global tensors assembled from every TP rank's shard (collective over TP)."""
    specs = shard_specs(model)
    out = {}
    for key, value in local_states(model, opt).items():
        name = key.split("/")[1]
        spec = specs.get(name)
        if spec is not None and value.dim() > 0:
            value = comm.all_gather_dim(value, spec.dim, tp_group, spec.sizes)
        out[key] = value
    return out


def assert_matches_reference(model, opt, reference: dict[str, torch.Tensor], what: str) -> int:
    """Every local tensor is bit-identical to its slice of the reference; returns how many were compared."""
    specs = shard_specs(model)
    local = local_states(model, opt)
    missing = sorted(set(reference) - set(local))
    assert not missing, f"{what}: not restored: {missing}"
    for key, value in local.items():
        full = reference[key]
        spec = specs.get(key.split("/")[1])
        expected = spec.slice_of(full) if spec is not None and value.dim() > 0 else full
        assert value.dtype == expected.dtype and torch.equal(value, expected), f"{what}: {key} differs"
    return len(local)
