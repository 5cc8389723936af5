"""The DeepSpeed engine with a world-sharded head (classes split over TP x DP) against the DDP engine
with the same head: the same weights and norms at ZeRO 0/1/2 in fp32 and bf16, clipping that bites,
a step skipped everywhere when one rank's head gradient turns non-finite, no byte of the head in
DeepSpeed's DP collectives, and checkpoints that load into DDP and back and resume bit-identically.

The DDP engine's handling of a world-sharded head is pinned against TP-only and unsharded references
in ``test_head_xc.py``; here it is the reference.
"""
import math

import pytest
import torch

import bigdense as bd
from bigdense.testing.counters import count_deepspeed_bytes
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.testing import run_ranks

from helpers import assert_close

D, C, B, ACCUM, STEPS, INJECT = 8, 37, 4, 2, 4, 2  # B rows per DP rank; INJECT: a step poisoned on one rank
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, grad_clip=0.2, weight_decay=0.1)  # norms ~0.5: clipping bites
# fp32: both engines compute the same gradients from the same weights (the head's world-sharded
# gradient is the layer's own; the replicated layer's is averaged over DP by DDP or by DeepSpeed,
# a sum of two halves either way), so the differences are AdamW's: fused (DDP) vs foreach (the
# DeepSpeed side) kernels round the update differently in the last bit, and Adam divides by
# sqrt(v), so a last-bit change becomes ~1e-7 of lr per step. Measured: <= 1.3e-6 relative on single
# weights, norms equal to 1e-7. Leaving the head's gradient unclipped moves the head by 2.5e-3
# relative; a norm without the head, or a head averaged over DP, by percents.
FP32 = dict(rtol=2e-5, atol=1e-6)
# bf16: DeepSpeed runs the forward and backward with bf16 weights (8-bit mantissa) where the fp32
# DDP reference keeps fp32 ones; Adam turns a gradient entry near 0 whose sign the rounding flips
# into a full lr step (1e-2) the other way, so single weights are no measure. Measured over these
# steps: norms within 0.12%, each weight tensor within 0.5% (relative Frobenius distance). A norm
# without the head is ~40% off; a head averaged over DP, or not stepped, moves it by >10%. (The
# fp32 cases pin the clipping and the masters' arithmetic exactly; this one their bf16 plumbing.)
BF16_NORM, BF16_WEIGHTS = dict(rtol=5e-3, atol=0.0), 2e-2


class HeadNet(torch.nn.Module):
    """A replicated layer and a big head: ``loss = head(tanh(fc(x)), y)``."""

    def __init__(self, shard="world"):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.head = bd.ParallelClassifierHead(D, C, bias=True, shard=shard)

    def forward(self, x, y):
        return self.head(torch.tanh(self.fc(x)), y.reshape(-1))


def _batches(step, ctx):
    g = torch.Generator().manual_seed(700 + step)
    rows = slice(ctx.dp_rank * B, (ctx.dp_rank + 1) * B)
    out = []
    for _ in range(ACCUM):
        x, y = torch.randn(B * ctx.dp_size, D, generator=g), torch.randint(0, C, (B * ctx.dp_size,), generator=g)
        out.append((x[rows], y[rows]))
    return out


def _engine(kind, stage=1, dtype="fp32", shard="world", steps=STEPS, frozen_head=False):
    ctx = bd.get_default_context()
    torch.manual_seed(0)
    model = HeadNet(shard)
    if frozen_head:
        model.head.requires_grad_(False)
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=kind, zero_stage=stage), optim_cfg=OPTIM,
                             precision_cfg=PrecisionConfig(dtype=dtype), micro_batch_size=B, grad_accum=ACCUM,
                             max_steps=steps)
    return engine, model


def _dense(model):
    """The head's full weight and bias and the replicated layer's weight, fp32."""
    head = model.head.to_dense()
    return [t.detach().float().clone() for t in (head.weight, head.bias, model.fc.weight)]


def _train(kind, stage=1, dtype="fp32", steps=STEPS, inject=INJECT):
    """Per-step (norm, skipped, lr) and the final dense weights; at step ``inject`` the head's
    weight gradient turns inf on the last rank only."""
    ctx = bd.get_default_context()
    engine, model = _engine(kind, stage, dtype, steps=steps)
    poison = {"on": False}
    last = ctx.rank == ctx.world_size - 1
    model.head.weight.register_hook(lambda g: g * math.inf if poison["on"] and last else g)
    out = []
    for step in range(steps):
        poison["on"] = step == inject
        before = _dense(model) if step == inject else None
        torch.manual_seed(100 + step)
        r = engine.train_step(_batches(step, ctx))
        if before is not None:
            assert r.skipped, f"{kind} zero-{stage} {dtype}: the poisoned step was applied"
            assert all(torch.equal(b, a) for b, a in zip(before, _dense(model))), "a skipped step changed weights"
        out.append((r.grad_norm, r.skipped, r.lr))
    return out, _dense(model)


def _compare(name, got, ref, dtype):
    (steps, weights), (ref_steps, ref_weights) = got, ref
    for i, ((norm, skipped, lr), (r_norm, r_skipped, r_lr)) in enumerate(zip(steps, ref_steps)):
        assert skipped == r_skipped == (i == INJECT), f"{name} step {i}: skipped={skipped}, reference {r_skipped}"
        assert lr == pytest.approx(r_lr, rel=1e-12), f"{name} step {i}: lr {lr} vs {r_lr}"
        if not skipped:
            assert r_norm > 2 * OPTIM.grad_clip, f"step {i}: clipping does not bite (norm {r_norm})"
            assert_close(torch.tensor(norm), torch.tensor(r_norm), f"{name} step {i} grad norm",
                         **(FP32 if dtype == "fp32" else BF16_NORM))
    for what, w, r in zip(("head weight", "head bias", "fc weight"), weights, ref_weights):
        if dtype == "fp32":
            assert_close(w, r, f"{name} {what}", **FP32)
        else:
            distance = float((w - r).norm() / r.norm())
            assert distance < BF16_WEIGHTS, f"{name} {what}: {distance:.2e} from the fp32 DDP run"


def _rank_cases(tp, cases):
    bd.init_parallel(tp=tp)
    ref = _train("ddp")
    return ref, {case: _train("deepspeed", *case) for case in cases}


def test_deepspeed_world_head_matches_ddp_at_zero_0_1_2():
    cases = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (0, "bf16"), (1, "bf16"), (2, "bf16")]
    for rank, (ref, by_case) in enumerate(run_ranks(_rank_cases, 2, 1, cases, timeout=300)):
        for (stage, dtype), got in by_case.items():
            _compare(f"deepspeed zero-{stage} {dtype} tp=1 x dp=2 rank {rank}", got, ref, dtype)


@pytest.mark.slow  # four ranks on two cores
def test_deepspeed_world_head_matches_ddp_tp2_dp2():
    for rank, (ref, by_case) in enumerate(run_ranks(_rank_cases, 4, 2, [(0, "fp32"), (2, "fp32")], timeout=300)):
        for (stage, dtype), got in by_case.items():
            _compare(f"deepspeed zero-{stage} {dtype} tp=2 x dp=2 rank {rank}", got, ref, dtype)


# ---- DeepSpeed's DP collectives ----
def _rank_bytes(stage, dtype):
    """DeepSpeed's bytes while it starts, and in two steps, for the world-sharded head, a frozen
    head and a DP-replicated one."""
    bd.init_parallel(tp=1)
    ctx = bd.get_default_context()
    out = []
    for shard, frozen in (("world", False), ("tp", True), ("tp", False)):
        with count_deepspeed_bytes() as start:
            engine, _ = _engine("deepspeed", stage, dtype, shard=shard, frozen_head=frozen)
        with count_deepspeed_bytes() as steps:
            for step in range(2):
                torch.manual_seed(100 + step)
                engine.train_step(_batches(step, ctx))
        out.append((start, steps))
    return out


@pytest.mark.slow  # nine DeepSpeed engines in two ranks
@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32")])
def test_deepspeed_reduces_no_byte_of_a_world_sharded_head(stage, dtype):
    # Steps: the reference is the same model with a frozen head, which DeepSpeed's reductions skip.
    # Start-up: DeepSpeed broadcasts the replicated layer only (fc's weight and bias; the frozen
    # head too, as it broadcasts every parameter). A DP-replicated head (tp=1, shard="tp") shows the
    # counting sees the head when it is there.
    size = 4 if dtype == "fp32" else 2
    head_bytes, fc_bytes = (C * D + C) * size, (D * D + D) * size
    for (world, world_steps), (frozen, frozen_steps), (_, replicated_steps) in run_ranks(
            _rank_bytes, 2, stage, dtype, timeout=300):
        assert world_steps == frozen_steps, f"zero-{stage} {dtype}: DeepSpeed moved head bytes: {world_steps}"
        assert world.get("broadcast") == fc_bytes and frozen.get("broadcast") == fc_bytes + head_bytes, (world, frozen)
        assert sum(replicated_steps.values()) >= sum(frozen_steps.values()) + 2 * head_bytes, replicated_steps


# ---- checkpoints ----
def _continue(engine, model):
    ctx = bd.get_default_context()
    for step in range(2, 4):
        torch.manual_seed(100 + step)
        engine.train_step(_batches(step, ctx))
    return _dense(model)


def _head_moment(engine, model):
    if engine.kind == "ddp":
        return engine.optimizer.state[model.head.weight]["exp_avg"].clone()
    world = engine.world
    return world.optimizer.state[world.masters[world.params.index(model.head.weight)]]["exp_avg"].clone()


def _rank_checkpoint(path, stage, dtype):
    """DeepSpeed (world head) trains 2 steps and saves. A fresh DeepSpeed engine resumes from it;
    the DDP engine loads it and saves; a fresh DeepSpeed engine loads that."""
    bd.init_parallel(tp=1)
    ctx = bd.get_default_context()
    ds, ds_model = _engine("deepspeed", stage, dtype)
    for step in range(2):
        torch.manual_seed(100 + step)
        ds.train_step(_batches(step, ctx))
    bd.save_checkpoint(path / "ds", **ds.checkpoint_state(), step=2)
    saved, saved_moment = _dense(ds_model), _head_moment(ds, ds_model)

    ddp, ddp_model = _engine("ddp", dtype="fp32")
    bd.load_checkpoint(path / "ds", **ddp.checkpoint_state())
    in_ddp, ddp_moment = _dense(ddp_model), _head_moment(ddp, ddp_model)
    bd.save_checkpoint(path / "ddp", **ddp.checkpoint_state(), step=2)

    resumed, resumed_model = _engine("deepspeed", stage, dtype)
    bd.load_checkpoint(path / "ds", **resumed.checkpoint_state())
    back, back_model = _engine("deepspeed", stage, dtype)
    bd.load_checkpoint(path / "ddp", **back.checkpoint_state())
    from_ddp, back_moment = _dense(back_model), _head_moment(back, back_model)
    return dict(saved=saved, saved_moment=saved_moment, in_ddp=in_ddp, ddp_moment=ddp_moment, from_ddp=from_ddp,
                back_moment=back_moment, straight=_continue(ds, ds_model), resumed=_continue(resumed, resumed_model),
                through_ddp=_continue(back, back_model))


@pytest.mark.slow  # DeepSpeed and DDP engines built several times in two ranks
@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16")])
def test_deepspeed_world_checkpoint_loads_into_ddp_and_back_and_resumes_exactly(tmp_path, stage, dtype):
    names = ("head weight", "head bias", "fc weight")
    for rank, r in enumerate(run_ranks(_rank_checkpoint, 2, tmp_path, stage, dtype, timeout=300)):
        name = f"zero-{stage} {dtype} rank {rank}"
        # Weights are exact at every hop (DDP's fp32 weights take DeepSpeed's bf16 ones exactly), and
        # so is the head's AdamW state.
        for what, a, b, c in zip(names, r["in_ddp"], r["saved"], r["from_ddp"]):
            assert torch.equal(a, b) and torch.equal(c, b), f"{name}: {what} changed through DDP"
        assert torch.equal(r["ddp_moment"], r["saved_moment"]) and torch.equal(r["back_moment"], r["saved_moment"])
        for what, a, b in zip(names, r["resumed"], r["straight"]):
            assert torch.equal(a, b), f"{name}: resumed run differs from the straight one: {what}"
        if dtype == "fp32":  # (bf16: DDP keeps no fp32 masters apart from its weights, so they come back rounded)
            for what, a, b in zip(names, r["through_ddp"], r["straight"]):
                assert torch.equal(a, b), f"{name}: a run resumed through DDP differs from the straight one: {what}"


def _rank_dense_load(stage):
    """A bf16 DeepSpeed engine (world head) trains 2 steps, then takes a plain state dict."""
    bd.init_parallel(tp=1)
    ctx = bd.get_default_context()
    engine, model = _engine("deepspeed", stage, "bf16")
    for step in range(2):
        torch.manual_seed(100 + step)
        engine.train_step(_batches(step, ctx))
    g = torch.Generator().manual_seed(5)
    plain = {"fc.weight": torch.randn(D, D, generator=g), "fc.bias": torch.randn(D, generator=g),
             "head.weight": torch.randn(C, D, generator=g), "head.bias": torch.randn(C, generator=g)}
    try:
        bd.load_dense_state_dict(engine.ds, plain)
        refused = None
    except TypeError as err:
        refused = str(err)
    bd.load_dense_state_dict(engine, plain)
    world = {n: (p, m) for n, p in model.named_parameters() for q, m in zip(engine.world.params, engine.world.masters)
             if p is q}
    return dict(refused=refused, dense=_dense(model), plain=plain,
                world={n: (p.detach().float(), m.detach().clone()) for n, (p, m) in world.items()},
                fc_master=_deepspeed_master(engine, model.fc.weight).clone())


def _deepspeed_master(engine, param):
    from deepspeed.utils import safe_get_full_fp32_param
    from bigdense.checkpoint import ds_state

    master = safe_get_full_fp32_param(param)
    if master is None:  # stage 0 bf16: DeepSpeed's unfused optimizer, which that API does not reach (ds_compat 7)
        lps, hps = ds_state.unfused_masters(engine.optimizer)
        master = next(hp for lp_group, hp_group in zip(lps, hps) for lp, hp in zip(lp_group, hp_group) if lp is param)
    return master


@pytest.mark.slow  # DeepSpeed engines in two ranks
@pytest.mark.parametrize("stage", [0, 1])
def test_dense_state_dict_reaches_the_world_heads_fp32_masters(stage):
    for rank, r in enumerate(run_ranks(_rank_dense_load, 2, stage, timeout=300)):
        name = f"zero-{stage} bf16 rank {rank}"
        # DeepSpeed's optimizer cannot see the world head's masters: its engine alone is refused.
        assert r["refused"] and "'head.weight'" in r["refused"] and "bigdense engine" in r["refused"], r["refused"]
        bf16 = {k: v.to(torch.bfloat16).float() for k, v in r["plain"].items()}
        for what, got, key in zip(("head weight", "head bias", "fc weight"), r["dense"],
                                  ("head.weight", "head.bias", "fc.weight")):
            assert torch.equal(got, bf16[key]), f"{name}: {what} not loaded"
        assert set(r["world"]) == {"head.weight", "head.bias"}, r["world"].keys()
        for what, (weight, master) in r["world"].items():
            assert torch.equal(master, weight), f"{name}: {what}'s fp32 master was left at the trained value"
        assert torch.equal(r["fc_master"], bf16["fc.weight"]), f"{name}: DeepSpeed's fc master not reloaded"


def test_config_accepts_a_world_sharded_head_with_deepspeed():
    from omegaconf import OmegaConf
    from bigdense.config import TrainConfig, validate

    cfg = OmegaConf.structured(TrainConfig)
    for key, value in {"engine.kind": "deepspeed", "head.shard": "world"}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    validate(cfg, world_size=2, device_type="cpu")
