"""A tied embedding/head is exported once, the Hugging Face way, and loads back into the plain
twin (``safetensors.torch.load_model``) and into sharded models (`load_dense_state_dict`)."""
import copy
import json

import safetensors.torch
import torch
import torch.nn as nn
from safetensors import safe_open

import bigdense as bd
from bigdense.testing import run_ranks

VOCAB, DIM, HIDDEN = 11, 6, 10  # vocabulary and hidden size uneven at tp=2
PLAN = {"emb": "vocab", "mlp.0": "column", "mlp.2": "row", "head": "head"}


class PlainLM(nn.Module):
    """The plain twin: an embedding tied to a bias-free output head, an MLP between them."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def _save_sharded(path):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    plain = PlainLM()
    model = bd.parallelize(copy.deepcopy(plain), PLAN)
    bd.save_checkpoint(path, model, step=1)
    return {k: v.clone() for k, v in plain.state_dict().items()}


def _load_into_sharded(file, tied):
    bd.init_parallel(tp=2)
    torch.manual_seed(1)  # other weights, so loading has to change them
    model = bd.parallelize(PlainLM(tied=tied), PLAN if tied else {k: v for k, v in PLAN.items() if k != "head"})
    bd.load_dense_state_dict(model, file)
    return {"emb.weight": model.emb.to_dense().weight.detach(), "mlp.2.weight": model.mlp[2].to_dense().weight.detach(),
            "head.weight": model.head.weight.detach() if not tied else model.emb.to_dense().weight.detach()}


def test_tied_weights_are_written_once_and_load_into_plain_and_sharded_models(tmp_path):
    reference = run_ranks(_save_sharded, 2, str(tmp_path / "ckpt" / "step_1"), timeout=120)[0]
    out = bd.export_dense(tmp_path / "ckpt" / "latest", tmp_path / "model.safetensors")

    with safe_open(str(out), "pt") as f:
        names, tied = sorted(f.keys()), json.loads(f.metadata()["tied"])
    assert names == ["emb.weight", "mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight"]
    assert tied == {"head.weight": "emb.weight"}
    # The file holds each unique parameter once: fp32 bytes plus a small header.
    unique_bytes = 4 * sum(p.numel() for p in PlainLM().parameters())
    assert unique_bytes < out.stat().st_size < unique_bytes + 4096

    twin = PlainLM()  # fresh weights; load_model knows head.weight is emb.weight
    safetensors.torch.load_model(twin, out)
    for name, value in reference.items():
        assert torch.equal(twin.state_dict()[name], value), name
    assert twin.head.weight is twin.emb.weight

    for tied_model in (True, False):  # an untied model takes the tied tensor under both names
        for got in run_ranks(_load_into_sharded, 2, str(out), tied_model, timeout=120):
            for name, value in got.items():
                assert torch.equal(value, reference[name]), (tied_model, name)
