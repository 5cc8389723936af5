"""Activation checkpointing: gradients with and without recompute are bit-identical, with dropout on.

`tp_dropout` draws its seeds from torch's CPU generator, which checkpoint restores before the
recompute; the recompute replays the same ops in the same order on the same inputs, so nothing
may differ by even one ulp: the comparison is ``torch.equal``. Each mode is checked at tp=1 (this
process) and tp=2 (two gloo ranks), and a forward-call count proves the recompute really ran.

The model is `helpers.TinyNet`, whose blocks have an ``attn`` with dropout on *sharded* hidden
units and an ``mlp`` with dropout on its *replicated* output.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.testing import run_ranks

from helpers import TinyNet, assert_close

MODES = ("none", "full", "mlp", "every_k")


def _count_forwards(model):
    """Calls of every linear layer's forward (hooks on the outer call of a checkpointed module do not
    fire again in its recompute, but those of modules inside it do)."""
    counts = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (bd.ColumnParallelLinear, bd.RowParallelLinear)):
            counts[name] = 0
            mod.register_forward_hook(lambda m, i, o, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _expected_forwards(name, mode, every):
    block, part = int(name.split(".")[1]), name.split(".")[2]
    recomputed = {"none": False, "full": True, "mlp": part == "mlp", "every_k": block % every == 0}[mode]
    return 2 if recomputed else 1


def _run(mode, seed=0, every=2, sliced=False):
    torch.manual_seed(seed)
    model = TinyNet()
    names = bd.apply_recompute(model.blocks, SimpleNamespace(mode=mode, every=every))
    counts = _count_forwards(model)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    torch.manual_seed(seed + 2)  # the dropout stream
    # As the engines do: the forward declares its rows of a global batch, backward runs outside.
    with bd.batch_slice(3, 12) if sliced else contextlib.nullcontext():
        loss = model(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counts, names, model


def _check_modes(tp):
    ref_loss, ref_grads, _, names, _ = _run("none")
    assert names == []
    for mode in MODES[1:]:
        loss, grads, counts, names, model = _run(mode)
        what = f"mode={mode}, tp={tp}"
        assert torch.equal(loss, ref_loss), f"{what}: loss {loss} != {ref_loss}"
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), f"{what}: gradient of {n} differs from the run without recompute"
        for n, c in counts.items():
            assert c == _expected_forwards(n, mode, 2), f"{what}: {n} ran forward {c} times"
        expected_names = {"full": ["0", "1", "2", "3"], "mlp": ["0.mlp", "1.mlp", "2.mlp", "3.mlp"],
                          "every_k": ["0", "2"]}[mode]
        assert names == expected_names, f"{what}: {names}"
        # Patched in place: parameter names (state-dict keys, checkpoints) do not change.
        assert list(model.state_dict()) == list(TinyNet().state_dict()), what
    return ref_loss.item()


def test_recompute_bit_identical_tp1():
    _check_modes(1)


def _tp2_rank():
    bd.init_parallel(tp=2)
    return _check_modes(2)


def test_recompute_bit_identical_tp2_and_tp_invariant():
    loss_tp1 = _check_modes(1)
    losses = run_ranks(_tp2_rank, 2, timeout=180)
    assert losses[0] == losses[1]
    # Same weights and masks at tp=1 and tp=2; the matmuls are split differently, so the loss moves
    # by a few ulps of fp32 (sums of ~24 terms per output): 1e-6 relative.
    assert_close(torch.tensor(losses[0]), torch.tensor(loss_tp1), "loss at tp=2 vs tp=1", rtol=1e-6, atol=0)


def test_recompute_reenters_the_forwards_batch_slice():
    ref_loss, ref_grads, *_ = _run("none", sliced=True)
    plain_loss, *_ = _run("none")
    assert not torch.equal(ref_loss, plain_loss)  # the slice does change the masks
    for mode in MODES[1:]:
        loss, grads, *_ = _run(mode, sliced=True)
        assert torch.equal(loss, ref_loss), mode
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), f"mode={mode}: gradient of {n} differs under batch_slice"


def test_eval_and_no_grad_do_not_checkpoint():
    torch.manual_seed(0)
    model = TinyNet()
    bd.apply_recompute(model.blocks, SimpleNamespace(mode="full", every=1))
    counts = _count_forwards(model)
    with torch.no_grad():
        model(torch.randn(2, 16), torch.randn(2, 16))
    assert set(counts.values()) == {1}


def test_reapply_switches_mode_and_none_undoes():
    torch.manual_seed(0)
    model = TinyNet()
    bd.apply_recompute(model.blocks, SimpleNamespace(mode="full", every=2))
    assert all(bd.is_checkpointed(b) for b in model.blocks)
    bd.apply_recompute(model.blocks, SimpleNamespace(mode="mlp", every=2))
    assert not any(bd.is_checkpointed(b) for b in model.blocks)
    assert all(bd.is_checkpointed(b.mlp) for b in model.blocks)
    bd.apply_recompute(model.blocks, SimpleNamespace(mode="none", every=2))
    assert not any(bd.is_checkpointed(m) for m in model.modules())


def test_bad_config_names_the_key():
    blocks = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"recompute.mode=mlp: block 0 \(Linear\) must expose its MLP"):
        bd.apply_recompute(blocks, SimpleNamespace(mode="mlp", every=2))
    with pytest.raises(ValueError, match="recompute.mode='selective' is not one of"):
        bd.apply_recompute(blocks, SimpleNamespace(mode="selective", every=2))
    with pytest.raises(ValueError, match="recompute.every must be a positive integer"):
        bd.apply_recompute(blocks, SimpleNamespace(mode="every_k", every=0))
