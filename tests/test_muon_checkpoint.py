"""Checkpoints of Muon runs (`bigdense.muon.Muon`): its state is layout-free, and it is never
taken for AdamW's (`bigdense.checkpoint.optimizer.check_optimizer_algorithm`).

The reference GPT (6 heads, d_model 36, d_hidden 47, vocabulary 67: uneven shards at tp 2 and 3;
tied embeddings; SwiGLU) trains with optim.name=muon under the DDP engine in fp32 at tp=2, and
saves after 3 steps. What this file proves:

* Resumed at tp=2, the next 2 steps' losses and the final weights are bit-identical to the
  uninterrupted tp=2 run's (a run that never saved): a load copies stored bytes, and the same
  layout sums in the same order.
* Loaded at tp=1 and tp=3, every weight, every Muon ``momentum_buffer`` and every AdamW moment,
  gathered to full tensors with plain collectives (not the checkpoint code), is bit-identical to the
  saved tp=2 state gathered the same way; the next 2 steps' losses match the tp=2 run's (the first
  reads the loaded weights, the second the update the loaded momentum and moments made).
* Under FSDP (saved at tp=1 x dp=2, loaded at tp=2 x dp=2) weights, momentum and moments -- DTensors
  on both sides -- arrive bit-identical too.
* An AdamW checkpoint loaded by a Muon run, and a Muon checkpoint by an AdamW run, raise
  `CheckpointError` on every rank naming both optimizers and their ``optim.name``, and change nothing
  (weights, optimizer state, schedule, RNG); the job's resume path names ``trainer.init_from`` as
  the way out, and that weights-only load does work.
"""
import pytest
import torch

import bigdense as bd
from bigdense.checkpoint import CheckpointError
from bigdense.checkpoint.adapters import resolve_optimizer
from bigdense.checkpoint.format import read_manifest
from bigdense.checkpoint.optimizer import check_optimizer_algorithm
from bigdense.checkpoint.split import OptimizerPair
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.config.schema import TrainerConfig
from bigdense.models import GPT, GPTConfig
from bigdense.parallel import comm
from bigdense.parallel.sharding import is_dtensor
from bigdense.testing import run_ranks
from bigdense.train.checkpointing import RunCheckpoints
from helpers import shard_specs

CFG = GPTConfig(vocab_size=67, n_layers=2, n_heads=6, d_model=36, d_hidden=47, activation="swiglu",
                tie_embeddings=True, bias=False, max_seq_len=16)
SAVED_AT, STEPS, GLOBAL_BATCH = 3, 5, 4
# Losses at tp=1 or tp=3 from the state saved at tp=2: the TP all-reduces and the sharded matmuls
# may sum in another order (measured in fp32: equal on these batches, 1.1e-7 relative on others);
# 1e-5 is far below what wrong state does -- the second step's loss reads the loaded momentum, and
# zeroing the buffers or shifting each by a row moves it by 9e-4 relative (measured).
LOSS_RTOL = 1e-5


def _batch(step: int):
    """The global batch of a step: tokens drawn per step, targets a fixed map of them, so the loss
    falls and each step's update matters."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.max_seq_len), generator=g)
    return x, (x * 5 + 3) % CFG.vocab_size


def _engine(ctx, optim="muon", kind="ddp", seed=0):
    """(model, engine): the reference GPT drawn after ``torch.manual_seed(seed)`` (the same global
    weights at any tp), under ``kind`` with ``optim``."""
    torch.manual_seed(seed)
    net = GPT(CFG, tp_group=ctx.tp_group)
    eng = bd.build_engine(net, ctx, engine_cfg=EngineConfig(kind=kind),
                          optim_cfg=OptimConfig(name=optim, lr=0.02, warmup_steps=2),
                          precision_cfg=PrecisionConfig(dtype="fp32"),
                          micro_batch_size=GLOBAL_BATCH // ctx.dp_size, max_steps=10)
    return net, eng


def _train(ctx, eng, start: int, stop: int) -> list[float]:
    """Steps ``start..stop-1``; DP rank ``d`` takes rows ``[d * b, (d + 1) * b)`` of each batch."""
    losses = []
    for step in range(start, stop):
        x, y = _batch(step)
        b = GLOBAL_BATCH // ctx.dp_size
        rows = slice(ctx.dp_rank * b, (ctx.dp_rank + 1) * b)
        losses.append(float(eng.train_step([(x[rows], y[rows])]).loss))
    return losses


def _full(value: torch.Tensor, spec, tp_group) -> torch.Tensor:
    """The full tensor of a rank's piece: FSDP's DP shards joined by ``full_tensor`` (an all-gather),
    then TP shards by an all-gather along the layer's split dim."""
    value = value.detach()
    if is_dtensor(value):
        value = value.full_tensor()
    if spec is not None and value.dim() > 0:
        value = comm.all_gather_dim(value.contiguous(), spec.dim, tp_group, spec.sizes)
    return value.clone()


def _full_state(net, eng, ctx) -> dict[str, torch.Tensor]:
    """``model/<name>`` and ``optim/<name>/<key>`` (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``,
    ``step``) as full tensors; collective over the mesh."""
    specs, out = shard_specs(net), {}
    for name, p in net.named_parameters():  # a tied weight once, as its state is kept once
        out[f"model/{name}"] = _full(p, specs.get(name), ctx.tp_group)
        for key, value in sorted(eng.optimizer.state.get(p, {}).items()):
            out[f"optim/{name}/{key}"] = _full(value, specs.get(name), ctx.tp_group)
    return out


def _weights(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.startswith("model/")}


def _differing(got: dict, want: dict) -> list[str]:
    """Keys missing on either side, or whose tensors are not bit-identical."""
    return sorted(k for k in got.keys() | want.keys()
                  if k not in got or k not in want or got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]))


# ---- the tp=2 run, saved after SAVED_AT steps ----
def _tp2_reference(path):
    """At tp=2: the uninterrupted run (its losses and final weights), and a run saved after
    SAVED_AT steps (its state then, gathered)."""
    ctx = bd.init_parallel(tp=2)
    net, eng = _engine(ctx)
    losses = _train(ctx, eng, 0, STEPS)
    final = _weights(_full_state(net, eng, ctx))
    net, eng = _engine(ctx)
    _train(ctx, eng, 0, SAVED_AT)
    bd.save_checkpoint(path, **eng.checkpoint_state(), step=SAVED_AT)
    return losses, final, _full_state(net, eng, ctx)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("muon") / "step_3"
    losses, final, saved = run_ranks(_tp2_reference, 2, path, timeout=120)[0]
    assert any(k.endswith("/momentum_buffer") for k in saved) and any(k.endswith("/exp_avg_sq") for k in saved)
    assert losses[-1] < losses[0]  # it learns: the steps compared below move the weights
    return path, losses, final, saved


def _resume(path, tp: int, steps: int):
    """Load at ``tp`` into a model drawn from another seed (so a missed tensor shows); the loaded
    state, gathered, and ``steps`` more steps' losses and final weights."""
    ctx = bd.init_parallel(tp=tp)
    net, eng = _engine(ctx, seed=1)
    bd.load_checkpoint(path, **eng.checkpoint_state())
    loaded = _full_state(net, eng, ctx)
    losses = _train(ctx, eng, SAVED_AT, SAVED_AT + steps)
    return loaded, losses, _weights(_full_state(net, eng, ctx))


def test_muon_resume_at_the_same_tp_is_bit_identical(tp2_run):
    path, losses, final, saved = tp2_run
    assert read_manifest(path)["optimizer_algorithm"] == "muon"
    loaded, resumed, weights = run_ranks(_resume, 2, path, 2, STEPS - SAVED_AT, timeout=120)[0]
    assert not _differing(loaded, saved)  # exact: bytes copied, then gathered
    assert resumed == losses[SAVED_AT:]  # exact: the same layout runs the same sums
    assert not _differing(weights, final)  # exact, for the same reason


@pytest.mark.parametrize("tp", [1, 3])
def test_muon_state_saved_at_tp2_loads_bit_identically_at_another_tp(tp2_run, tp):
    path, losses, _, saved = tp2_run
    loaded, resumed, _ = run_ranks(_resume, tp, path, tp, STEPS - SAVED_AT, timeout=120)[0]
    assert not _differing(loaded, saved), f"tp={tp}: not the saved bits"  # exact: bytes copied, then gathered
    assert resumed == pytest.approx(losses[SAVED_AT:], rel=LOSS_RTOL)


# ---- FSDP ----
def _fsdp_save(path):
    """FSDP at tp=1 x dp=2: SAVED_AT steps, saved; the state then, gathered."""
    ctx = bd.init_parallel(tp=1)
    net, eng = _engine(ctx, kind="fsdp")
    assert is_dtensor(next(net.parameters()))  # FSDP applied: the momentum buffers will be DTensors too
    _train(ctx, eng, 0, SAVED_AT)
    bd.save_checkpoint(path, **eng.checkpoint_state(), step=SAVED_AT)
    return _full_state(net, eng, ctx)


def _fsdp_load(path):
    """FSDP at tp=2 x dp=2: the checkpoint loaded, its state gathered."""
    ctx = bd.init_parallel(tp=2)
    net, eng = _engine(ctx, kind="fsdp", seed=1)
    assert is_dtensor(next(net.parameters()))  # FSDP applied here too, over dp=2 of each TP shard
    bd.load_checkpoint(path, **eng.checkpoint_state())
    return _full_state(net, eng, ctx)


def test_muon_state_under_fsdp_loads_bit_identically_at_another_layout(tmp_path):
    path = tmp_path / "step_3"
    saved = run_ranks(_fsdp_save, 2, path, timeout=120)[0]
    assert any(k.endswith("/momentum_buffer") for k in saved)
    loaded = run_ranks(_fsdp_load, 4, path, timeout=120)[0]
    assert not _differing(loaded, saved)  # exact: both sides copy and gather bytes, nothing is summed


# ---- the algorithm check ----
def test_each_adapter_records_its_algorithm():
    """Muon's attribute names it; every other torch optimizer is AdamW's; a main optimizer paired
    with the world-sharded parameters' AdamW (FSDP, DeepSpeed) is the main one's; a checkpoint
    without the record is AdamW's."""
    w = torch.nn.Parameter(torch.zeros(2, 2))

    class MuonLike(torch.optim.SGD):
        algorithm = "muon"

    adamw, muon = torch.optim.AdamW([w]), MuonLike([w], lr=0.1)
    assert resolve_optimizer(adamw, None).algorithm == "adamw"
    assert resolve_optimizer(muon, None).algorithm == "muon"
    assert resolve_optimizer(OptimizerPair(adamw, adamw, [0], [0]), None).algorithm == "adamw"
    assert resolve_optimizer(OptimizerPair(muon, adamw, [0], [0]), None).algorithm == "muon"
    check_optimizer_algorithm("old", None, "adamw")
    with pytest.raises(CheckpointError, match=r"AdamW's \(optim.name=adamw\).*Muon \(optim.name=muon\)"):
        check_optimizer_algorithm("old", None, "muon")


def _refused(ckpt, optim: str):
    """A run with ``optim`` (one step trained: state to keep) loads ``ckpt``: the error, and whether
    weights, optimizer state, schedule and RNG are as they were."""
    ctx = bd.get_default_context()
    net, eng = _engine(ctx, optim=optim, seed=1)
    _train(ctx, eng, 0, 1)
    parts = eng.checkpoint_state()  # brings the host's scheduler up to the step counter first
    before, epoch, rng = _full_state(net, eng, ctx), eng.scheduler.last_epoch, torch.get_rng_state()
    with pytest.raises(CheckpointError) as caught:
        bd.load_checkpoint(ckpt, **parts)
    untouched = (not _differing(_full_state(net, eng, ctx), before) and eng.scheduler.last_epoch == epoch
                 and torch.equal(torch.get_rng_state(), rng))
    return str(caught.value), untouched


def _refusals(run_dir, muon_ckpt):
    """At tp=2: an AdamW run saved into ``run_dir``'s checkpoints, then each optimizer refusing the
    other's checkpoint; the job's resume of a Muon run over AdamW's checkpoints; and the way out, a
    weights-only load (what trainer.init_from does)."""
    ctx = bd.init_parallel(tp=2)
    net, eng = _engine(ctx, optim="adamw")
    _train(ctx, eng, 0, 1)
    adamw_ckpt = run_dir / "checkpoints" / "step_0000001"
    bd.save_checkpoint(adamw_ckpt, **eng.checkpoint_state(), step=1)
    adamw_weights = _weights(_full_state(net, eng, ctx))
    out = {"muon": _refused(adamw_ckpt, "muon"), "adamw": _refused(muon_ckpt, "adamw")}
    net, eng = _engine(ctx, optim="muon", seed=1)
    with pytest.raises(CheckpointError) as caught:
        RunCheckpoints(run_dir / "checkpoints", eng, TrainerConfig()).load_latest()
    out["resume"] = str(caught.value)
    bd.load_checkpoint(adamw_ckpt, net, load_rng=False)  # parallelize_model's load of trainer.init_from
    out["init_from"] = not _differing(_weights(_full_state(net, eng, ctx)), adamw_weights)
    return out


def test_adamw_and_muon_checkpoints_are_refused_by_the_other_optimizer(tp2_run, tmp_path):
    muon_ckpt = tp2_run[0]
    results = run_ranks(_refusals, 2, tmp_path / "run", muon_ckpt, timeout=120)
    assert results[0] == results[1]  # every rank refuses, alike
    out = results[0]
    message, untouched = out["muon"]
    assert "the checkpoint's optimizer state is AdamW's (optim.name=adamw)" in message, message
    assert "this run's optimizer is Muon (optim.name=muon)" in message, message
    assert "trainer.init_from=" in message and "keep optim.name=adamw" in message, message
    assert untouched
    message, untouched = out["adamw"]
    assert "the checkpoint's optimizer state is Muon's (optim.name=muon)" in message, message
    assert "this run's optimizer is AdamW (optim.name=adamw)" in message, message
    assert f"trainer.init_from={muon_ckpt}" in message and "keep optim.name=muon" in message, message
    assert untouched
    resume = out["resume"]  # the job's words around it: where to go on from
    assert resume.startswith("cannot resume ") and "optim.name=adamw" in resume, resume
    assert "trainer.init_from=" in resume and "trainer.resume=false" in resume, resume
    assert out["init_from"]
