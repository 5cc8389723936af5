"""DeepSpeed ZeRO checkpoints and plain-optimizer checkpoints load into each other at any layout.

Chain: a plain AdamW checkpoint (tp=1, one process) -> DeepSpeed ZeRO-1 at tp=2 x dp=2, which
trains on and saves -> a plain AdamW model at tp=1, and -> ZeRO-2 at tp=1 x dp=2. DeepSpeed's
state is read back with its own per-parameter API (gathered over DP, then over TP with plain
collectives) and compared bit for bit with the reference; so are its fp32 master weights, which
must follow the loaded model weights or the next step would undo the load. A bf16 ZeRO-1 round
trip shows the saved fp32 masters (not the bf16 weights) are what come back.
"""

import deepspeed
import pytest
import torch

import bigdense as bd
from bigdense.parallel import comm
from bigdense.testing import run_ranks

from helpers import (
    TinyLM, assert_matches_reference, batch, full_states, make_optimizer, shard_specs, train_steps,
)

pytestmark = pytest.mark.slow  # DeepSpeed engines at several layouts

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _engine(ctx, stage, bf16=False, seed=None):
    torch.manual_seed(100 + ctx.rank if seed is None else seed)  # unlike the checkpoint's: a no-op load fails
    model = TinyLM(dropout=0.0 if bf16 else 0.1)
    config = {
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=bd.DeepSpeedMPU(ctx), model_parameters=model.parameters())
    return engine


def _ds_states(engine, ctx):
    """Global tensors of the engine: model, fp32 masters and Adam state (collective over DP and TP)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    specs = shard_specs(engine.module)
    wrapper = engine.optimizer
    step_of = {}
    for lps, flat in zip(wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups):
        for p in lps:
            step_of[id(p)] = wrapper.optimizer.state[flat]["step"]
    out = full_states(engine.module, None, ctx.tp_group)
    for name, p in engine.module.named_parameters():
        spec = specs.get(name)
        values = {key: safe_get_full_optimizer_state(p, key) for key in ADAM_KEYS}
        values["master"] = safe_get_full_fp32_param(p)
        for key, value in values.items():
            if spec is not None:
                value = comm.all_gather_dim(value, spec.dim, ctx.tp_group, spec.sizes)
            out[f"optim/{name}/{key}"] = value
        out[f"optim/{name}/step"] = step_of[id(p)].clone()
    return out


def _assert_ds_equals(states, reference, what):
    """``states`` (from `_ds_states`) equal ``reference``; masters are compared with the reference's own
    masters if it has them (a DeepSpeed reference), else with its fp32 model weights."""
    for key, value in states.items():
        ref_key = key
        if key.endswith("/master") and key not in reference:
            ref_key = key.replace("/master", "").replace("optim/", "model/")
        assert torch.equal(value, reference[ref_key]), f"{what}: {key} differs"


def _zero1_run(plain_ckpt, reference, ds_ckpt):
    ctx = bd.init_parallel(tp=2)
    engine = _engine(ctx, stage=1)
    info = bd.load_checkpoint(plain_ckpt, engine)
    assert info.step == 2 and engine.global_steps == 0
    _assert_ds_equals(_ds_states(engine, ctx), reference, f"plain -> ZeRO-1 rank {ctx.rank}")
    # One step on the same data everywhere: must continue the plain run (uses the loaded moments).
    engine.backward(engine(*batch(2)))
    engine.step()
    after_one_step = full_states(engine.module, None, ctx.tp_group)
    loss = engine(*batch(100 + ctx.dp_rank))  # DP ranks see different data
    engine.backward(loss)
    engine.step()
    bd.save_checkpoint(ds_ckpt, engine)
    return _ds_states(engine, ctx), after_one_step


def _zero2_run(ds_ckpt, reference):
    ctx = bd.init_parallel(tp=1)
    engine = _engine(ctx, stage=2)
    # As bigdense's training engines pass it: the module and DeepSpeed's optimizer wrapper.
    info = bd.load_checkpoint(ds_ckpt, engine.module, engine.optimizer)
    assert info.step == 2 and engine.global_steps == 0
    _assert_ds_equals(_ds_states(engine, ctx), reference, f"ZeRO-1 tp2xdp2 -> ZeRO-2 tp1xdp2 rank {ctx.rank}")
    bd.load_checkpoint(ds_ckpt, engine)
    assert engine.global_steps == 2  # given the engine, its counters travel with the checkpoint too
    return True


def test_zero_and_plain_optimizer_checkpoints_load_into_each_other_at_other_layouts(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, 0, 2)
    bd.save_checkpoint(tmp_path / "plain", model, opt, step=2)
    plain_reference = full_states(model, opt)

    ds_reference, ds_after_one_step = run_ranks(_zero1_run, 4, str(tmp_path / "plain"), plain_reference,
                                                str(tmp_path / "zero1"), timeout=240)[0]
    train_steps(model, opt, sched, 2, 3)
    for key, value in full_states(model).items():
        # Same update, but DeepSpeed sums the TP partial products and averages over DP in another
        # order: fp32 rounding in the gradients, damped by Adam's normalisation, ~1e-7 here.
        torch.testing.assert_close(ds_after_one_step[key], value, atol=1e-6, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    # The optimizer did move on from the plain state (a no-op run would not test the load below).
    assert not torch.equal(ds_reference["optim/mlp.up.weight/exp_avg"], plain_reference["optim/mlp.up.weight/exp_avg"])

    torch.manual_seed(1)
    model = TinyLM()
    opt, _ = make_optimizer(model)
    bd.load_checkpoint(tmp_path / "zero1", model, opt)
    plain_view = {k: v for k, v in ds_reference.items() if not k.endswith("/master")}
    assert_matches_reference(model, opt, plain_view, "ZeRO-1 tp2xdp2 -> plain AdamW tp=1")

    assert run_ranks(_zero2_run, 2, str(tmp_path / "zero1"), ds_reference, timeout=240) == [True, True]


def _bf16_round_trip(ckpt):
    ctx = bd.init_parallel(tp=2)
    engine = _engine(ctx, stage=1, bf16=True, seed=0)
    for step in range(3):
        engine.backward(engine(*batch(step)))
        engine.step()
    bd.save_checkpoint(ckpt, engine.module, engine.optimizer)
    reference = _ds_states(engine, ctx)
    fresh = _engine(ctx, stage=1, bf16=True, seed=5)
    bd.load_checkpoint(ckpt, fresh.module, fresh.optimizer)
    _assert_ds_equals(_ds_states(fresh, ctx), reference, f"bf16 ZeRO-1 rank {ctx.rank}")
    return reference


def test_bf16_zero1_round_trip_restores_the_fp32_master_weights(tmp_path):
    reference = run_ranks(_bf16_round_trip, 2, str(tmp_path / "bf16"), timeout=240)[0]
    weight, master = reference["model/mlp.up.weight"], reference["optim/mlp.up.weight/master"]
    # The masters carry bits the bf16 weights lack: restoring them from the weights would not do.
    assert weight.dtype == torch.bfloat16 and not torch.equal(master, weight.float())
    assert torch.equal(master.bfloat16(), weight)
