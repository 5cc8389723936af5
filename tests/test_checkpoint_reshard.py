"""A checkpoint saved at one TP x DP layout loads bit-identically at another, model and optimizer state.

One reference state (3 AdamW steps at tp=2, gathered with plain collectives) is carried through a
chain of saves and loads: tp=2 -> {tp=1 (no process group), tp=3, tp=4}; the tp=3 copy -> tp=2 x dp=2
(under DDP), saved again from there -> tp=1, and exported to one dense file. Every rank compares
every tensor it holds (uneven shards included) with torch.equal against its slice of the reference.
"""
import json
import math

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import bigdense as bd
from bigdense.testing import run_ranks

from helpers import (
    TinyLM, assert_matches_reference, batch, full_states, make_optimizer, train_steps,
)


def _fresh(seed):
    """A model and optimizer whose values differ from the reference's, so a no-op load fails."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt, sched = make_optimizer(model, lr=5e-4)
    return model, opt, sched


def _save_reference(ckpt):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 3)
    bd.save_checkpoint(ckpt, model, opt, scheduler=sched, step=3)
    model.eval()
    eval_loss = model(*batch(99)).item()
    return full_states(model, opt, ctx.tp_group), eval_loss, sched.state_dict()


def _load_and_check(ckpt, reference, tp, resave=None, ddp=False):
    ctx = bd.init_parallel(tp=tp)
    model, opt, sched = _fresh(seed=100 + ctx.rank)
    wrapped = nn.parallel.DistributedDataParallel(model, process_group=ctx.dp_group) if ddp else model
    info = bd.load_checkpoint(ckpt, wrapped, opt, scheduler=sched)
    where = f"tp={ctx.tp_size} dp={ctx.dp_size} rank {ctx.rank}"
    count = assert_matches_reference(model, opt, reference, where)
    model.eval()
    eval_loss = model(*batch(99)).item()
    if resave:
        bd.save_checkpoint(resave, wrapped, opt, scheduler=sched, step=info.step)
    return count, info.step, info.saved_layout, eval_loss, sched.state_dict(), opt.param_groups[0]["lr"]


def test_save_at_tp2_loads_bit_identically_at_tp_1_3_4_and_after_dp_changes(tmp_path):
    ckpt_a, ckpt_b, ckpt_c = tmp_path / "a" / "step_3", tmp_path / "b" / "step_3", tmp_path / "c" / "step_3"
    reference, ref_loss, ref_sched = run_ranks(_save_reference, 2, str(ckpt_a), timeout=120)[0]
    assert (tmp_path / "a" / "latest").read_text().strip() == "step_3"

    def check(results, saved_layout):
        for count, step, layout, eval_loss, sched_state, lr in results:
            assert count == len(reference) and step == 3 and layout == saved_layout
            assert sched_state == ref_sched and lr == ref_sched["_last_lr"][0]
            # The loss of the loaded model equals the saved one up to the order of the TP sums
            # (all-reduce of partial products, split softmax statistics): fp32 rounding, ~1e-7 relative.
            assert abs(eval_loss - ref_loss) <= 1e-5 * abs(ref_loss), (eval_loss, ref_loss)

    check([_load_and_check(tmp_path / "a" / "latest", reference, 1)], {"tp": 2, "dp": 1, "world_size": 2})
    bd.destroy_parallel()
    check(run_ranks(_load_and_check, 3, str(ckpt_a), reference, 3, str(ckpt_b), timeout=120),
          {"tp": 2, "dp": 1, "world_size": 2})
    check(run_ranks(_load_and_check, 4, str(ckpt_a), reference, 4, timeout=120), {"tp": 2, "dp": 1, "world_size": 2})
    # Saved at tp=3 (uneven the other way) -> tp=2 x dp=2 under DDP, which saves again with DP replicas.
    check(run_ranks(_load_and_check, 4, str(ckpt_b), reference, 2, str(ckpt_c), True, timeout=120),
          {"tp": 3, "dp": 1, "world_size": 3})
    check([_load_and_check(ckpt_c, reference, 1)], {"tp": 2, "dp": 2, "world_size": 4})

    # The DP replicas of each TP rank shared out the writing: one model and one optimizer file per
    # (TP, DP) rank, one RNG file per rank, and each replica wrote about half of its TP rank's bytes.
    files = sorted(p.name for p in ckpt_c.iterdir())
    shard_files = [f"{kind}-tp0{t}-of-02-dp0{d}-of-02.safetensors" for kind in ("model", "optim")
                   for t in range(2) for d in range(2)]
    assert files == sorted(["common.pt", "manifest.json", *shard_files, *[f"rank0000{r}.pt" for r in range(4)]])
    manifest = json.loads((ckpt_c / "manifest.json").read_text())
    largest = max(4 * max(1, math.prod(s["shape"])) for e in manifest["tensors"].values() for s in e["shards"])
    for t in range(2):
        per_replica = [sum((ckpt_c / f).stat().st_size for f in shard_files if f"-tp0{t}-" in f and f"-dp0{d}-" in f)
                       for d in range(2)]
        assert abs(per_replica[0] - per_replica[1]) <= largest + 2048, per_replica  # greedy by bytes; headers differ

    # Offline export: one file, plain names, full tensors equal to the reference.
    dense = load_file(bd.export_dense(ckpt_c, tmp_path / "dense.safetensors"))
    model_ref = {k[len("model/"):]: v for k, v in reference.items() if k.startswith("model/")}
    model_ref.pop("head.weight", None)  # tied to emb.weight: written once, under the embedding's name
    assert sorted(dense) == sorted(model_ref)
    for name, value in model_ref.items():
        assert torch.equal(dense[name], value), name


def test_one_process_save_and_load_without_a_process_group_and_strict_names(tmp_path):
    """Without any process group: save, change, load restores; strict=False reports extra names."""
    torch.manual_seed(0)
    model = TinyLM(dropout=0.0)
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 2)
    reference = full_states(model, opt)
    bd.save_checkpoint(tmp_path / "s", model, opt, scheduler=sched, extra={"pos": 2})
    train_steps(model, opt, sched, 2, 4)  # move away from the saved state
    info = bd.load_checkpoint(tmp_path, model, opt, scheduler=sched)  # the directory holding `latest`
    assert info.extra == {"pos": 2} and info.missing == [] and info.unexpected == []
    assert_matches_reference(model, opt, reference, "tp=1")

    class TinyLMPlus(TinyLM):
        def __init__(self):
            super().__init__(dropout=0.0)
            self.extra = nn.Linear(2, 2)

    bigger = TinyLMPlus()
    with pytest.raises(bd.CheckpointError, match=r"missing from the checkpoint \['extra.weight', 'extra.bias'\]"):
        bd.load_checkpoint(tmp_path / "s", bigger)
    info = bd.load_checkpoint(tmp_path / "s", bigger, strict=False)
    assert info.missing == ["extra.weight", "extra.bias"] and info.unexpected == []
    assert torch.equal(bigger.mlp.up.weight, model.mlp.up.weight)
