"""The FSDP engine (`engine=fsdp`): FSDP2 over DP composed with bigdense's TP.

Parity: 20 steps of the reference GPT (dropout on) at tp=2 x dp=2 under FSDP against the DDP engine
at the same layout and against one process (tp=1), with and without sequence parallelism,
compiled blocks, recompute and gradient accumulation, with a world-sharded head, in fp32 and bf16; HSDP. The same
global batches and dropout masks reach every layout (the sampler is a function of the step, DP
ranks take row slices, `tp_dropout` is TP- and DP-invariant), so what differs is the order of
floating-point sums: FSDP's reduce-scatter instead of DDP's all-reduce, the TP sums. Checkpoints:
saved by FSDP at tp=2 x dp=2, loaded by FSDP at tp=1 x dp=4 and under HSDP, by DDP, by DeepSpeed
ZeRO-1 and by one process, and back, all bit-exact; resume bit-identical.
"""
import numpy as np
import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig, RecomputeConfig
from bigdense.errors import ConfigError
from bigdense.models import GPT, GPTConfig
from bigdense.models.classifier import TextClassifier
from bigdense.testing import run_ranks
from bigdense.train.compile import compile_blocks
from bigdense.train.recompute import apply_recompute

STEPS, GLOBAL_BATCH, SEQ, VOCAB, CLASSES = 20, 4, 32, 515, 301  # 515, 301: uneven over 2 and 4 ranks
# fp32 against DDP at the same layout and against tp=1: measured at most 2.6e-7 relative in the
# loss and 4.8e-7 in the gradient norm over the 20 steps, in every variant (the sums' order); allowed
# 2e-6 and 1e-5, as the DDP parity test does (Adam's normalised updates carry rounding forward). A
# missed or doubled reduction, or a gradient summed instead of averaged over DP, moves the loss by
# 1e-3 within a few steps.
FP32 = dict(loss=2e-6, norm=1e-5)
# bf16: FSDP computes with bf16 copies of the parameters (norms, embeddings and the residual stream
# in bf16), DDP under autocast with fp32 ones. Measured: FSDP bf16 against fp32 tp=1 at most 5.6e-4
# relative in the loss and 2.7e-3 in the norm (DDP bf16: 4.2e-4 and 1.2e-3), FSDP against DDP bf16
# 3.5e-4 and 1.9e-3. Allowed 1e-2 and 2e-2 (bf16's unit roundoff is 3.9e-3): a wrong reduction
# is off by far more.
BF16 = dict(loss=1e-2, norm=2e-2)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=3)


def _global_batch(step):
    """Tokens drawn from 16 ids spread over the vocabulary, labels from the first token: a model
    learns their frequencies within a few steps, so the losses move and the comparison means something."""
    g = np.random.default_rng([7, step])
    tokens = torch.from_numpy(g.choice(np.arange(0, VOCAB, 32), size=(GLOBAL_BATCH, SEQ + 1)))
    return tokens[:, :-1], tokens[:, 1:]


def _model(ctx, model, sequence_parallel):
    cfg = GPTConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=SEQ, dropout=0.1,
                    head_chunk_size=48, sequence_parallel=sequence_parallel)
    if model == "world_head":  # the GPT's trunk under a classifier head split over every rank
        return TextClassifier(cfg, CLASSES, tp_group=ctx.tp_group, dp_group=ctx.dp_group, shard="world")
    return GPT(cfg, tp_group=ctx.tp_group)


def _engine(tp, engine, *, model="gpt", sp=False, compile=False, recompute=False, accum=1, dtype="fp32",
            replicate=1, seed=0, steps=STEPS):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(seed)
    net = _model(ctx, model, sp)
    if compile:  # in the jobs' order: TP, compile, recompute, the engine
        compile_blocks(net.blocks, "aot_eager")
    if recompute:
        apply_recompute(net.blocks, RecomputeConfig(mode="full"))
    return ctx, bd.build_engine(
        net, ctx, engine_cfg=EngineConfig(kind=engine, zero_stage=1, dp_replicate=replicate), optim_cfg=OPTIM,
        precision_cfg=PrecisionConfig(dtype=dtype), micro_batch_size=GLOBAL_BATCH // accum // ctx.dp_size,
        grad_accum=accum, max_steps=steps)


def _micro_batches(ctx, engine, step, model="gpt"):
    """Global micro-batch ``i`` is rows ``[i * n, (i + 1) * n)`` of the step's batch; DP rank ``d`` takes
    its rows ``[d * b, (d + 1) * b)`` of it."""
    x, y = _global_batch(step)
    if model == "world_head":
        y = x[:, 0] * 7 % CLASSES
    b, out = engine.micro_batch_size, []
    for i in range(engine.grad_accum):
        n = b * ctx.dp_size
        rows = slice(i * n + ctx.dp_rank * b, i * n + (ctx.dp_rank + 1) * b)
        out.append((x[rows], y[rows]))
    return out


def _train(tp, engine, **options):
    ctx, eng = _engine(tp, engine, **options)
    results = []
    for step in range(STEPS):  # as a training run: host checks on for the first step only (compiled blocks
        with bd.set_checks(step == 0):  # run eagerly while they are on)
            results.append(eng.train_step(_micro_batches(ctx, eng, step, options.get("model", "gpt"))))
    return [r.loss for r in results], [r.grad_norm for r in results]


def _assert_agree(runs: dict, tol: dict):
    """Every rank of every run against the first run's rank 0, step by step."""
    (ref_name, ref), *others = runs.items()
    ref_losses, ref_norms = map(np.array, ref[0])
    assert ref_losses[-1] < ref_losses[0] - 0.3, "the reference run should learn something in 20 steps"
    for name, per_rank in others:
        for rank, (losses, norms) in enumerate(per_rank):
            np.testing.assert_allclose(losses, ref_losses, rtol=tol["loss"], atol=0,
                                       err_msg=f"{name} rank {rank}: loss against {ref_name}")
            np.testing.assert_allclose(norms, ref_norms, rtol=tol["norm"], atol=0,
                                       err_msg=f"{name} rank {rank}: grad norm against {ref_name}")


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {},
    dict(sp=True, compile=True, recompute=True, accum=2),
    dict(model="world_head", accum=2),
], ids=["plain", "sp-compile-recompute-accum", "world-head-accum"])
def test_fsdp_tp2_dp2_matches_ddp_and_one_process_fp32(options):
    _assert_agree({
        "tp=1": run_ranks(_train, 1, 1, "ddp", **{k: v for k, v in options.items() if k not in ("sp", "compile")}),
        "FSDP tp=2 x dp=2": run_ranks(_train, 4, 2, "fsdp", **options),
        "DDP tp=2 x dp=2": run_ranks(_train, 4, 2, "ddp", **options),
    }, FP32)


@pytest.mark.slow
def test_fsdp_bf16_matches_ddp_bf16_and_fp32_within_bf16_rounding():
    _assert_agree({
        "tp=1 fp32": run_ranks(_train, 1, 1, "ddp"),
        "FSDP tp=2 x dp=2 bf16": run_ranks(_train, 4, 2, "fsdp", dtype="bf16"),
        "DDP tp=2 x dp=2 bf16": run_ranks(_train, 4, 2, "ddp", dtype="bf16"),
    }, BF16)


@pytest.mark.slow
def test_hsdp_replicas_match_ddp():
    """dp=4 as 2 replicas of 2 shards: the norm counts each replica's shard once."""
    _assert_agree({
        "DDP tp=1 x dp=4": run_ranks(_train, 4, 1, "ddp"),
        "HSDP tp=1 x (2 x 2)": run_ranks(_train, 4, 1, "fsdp", replicate=2),
    }, FP32)


# ---- quick cases ----
def _averaged_gradient(force_sum: bool):
    """One Linear under FSDP's defaults or bigdense's setting, each DP rank a different input."""
    from torch.distributed.fsdp import fully_shard

    ctx = bd.init_parallel(tp=1)
    layer = nn.Linear(4, 4, bias=False)
    fully_shard(layer, mesh=ctx.mesh["dp"])
    if force_sum:
        layer.set_force_sum_reduction_for_comms(True)
    layer(torch.full((1, 4), float(ctx.dp_rank + 1))).sum().backward()
    return layer.weight.grad.full_tensor()


def _engine_gradient():
    ctx = bd.init_parallel(tp=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loss_model = _MeanSquare(model)
    engine = bd.build_engine(loss_model, ctx, engine_cfg=EngineConfig(kind="fsdp"),
                             optim_cfg=OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=0.0),
                             precision_cfg=PrecisionConfig(), micro_batch_size=2, max_steps=2)
    x = torch.arange(8.0).reshape(4, 2).repeat(1, 2)  # the global batch; DP rank d takes rows 2d, 2d + 1
    rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    engine.train_step([(x[rows], x[rows, :3])])
    return {name: p.grad.full_tensor() for name, p in loss_model.named_parameters()}


class _MeanSquare(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return (self.net(x) - y).square().mean()


def test_gloo_averages_gradients_over_dp_pytorch_162338():
    """pytorch#162338: FSDP2 on gloo summed gradients instead of averaging them. The engine takes
    the average as a sum and a division on gloo; both it and FSDP2's own default must give the mean
    of the ranks' gradients (the input's mean is 1.5 here, the sum would be 3)."""
    for force_sum in (False, True):
        for grad in run_ranks(_averaged_gradient, 2, force_sum):
            assert torch.equal(grad, torch.full((4, 4), 1.5)), (force_sum, grad)
    torch.manual_seed(0)
    reference = _MeanSquare(nn.Sequential(nn.Linear(4, 3)))
    x = torch.arange(8.0).reshape(4, 2).repeat(1, 2)
    # The mean of the two DP ranks' mean losses is the mean loss over the global batch (equal halves).
    reference(x, x[:, :3]).backward()
    for grads in run_ranks(_engine_gradient, 2):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=0, msg=name)


def _sharding():
    ctx, eng = _engine(2, "fsdp", model="world_head", steps=2)
    model = eng.model
    shapes = {name: (tuple(getattr(p, "_local_tensor", p).shape), tuple(p.shape))
              for name, p in model.named_parameters()}
    world = {name for name, p in model.named_parameters() if getattr(p, "bd_shard_spec", None) is not None
             and p.bd_shard_spec.group == "world"}
    eng.train_step(_micro_batches(ctx, eng, 0, "world_head"))
    return shapes, world, type(model.head.weight).__name__, type(model.blocks[0].mlp.up.weight).__name__


def test_each_rank_holds_a_dp_slice_of_its_tp_shard_and_the_world_head_is_left_alone():
    for shapes, world, head_type, block_type in run_ranks(_sharding, 4):
        assert world == {"head.weight", "head.bias"} and head_type == "Parameter" and block_type == "DTensor"
        for name, (held, tp_local) in shapes.items():
            if name in world:
                assert held == tp_local, name
            else:  # dim 0 of the TP-local tensor split over the 2 DP ranks
                assert held[0] <= -(-tp_local[0] // 2) and held[1:] == tp_local[1:], (name, held, tp_local)


def _bad_replicate():
    bd.init_parallel(tp=1)
    with pytest.raises(ConfigError, match=r"engine.dp_replicate=3 must divide the DP size \(2\)"):
        _engine(1, "fsdp", replicate=3)
    return True


def test_hsdp_replicas_must_divide_dp():
    assert all(run_ranks(_bad_replicate, 2))


# ---- checkpoints ----
def _continue(ctx, eng, start, stop):
    return [eng.train_step(_micro_batches(ctx, eng, step)).loss for step in range(start, stop)]


def _save_fsdp(path):
    ctx, eng = _engine(2, "fsdp")
    _continue(ctx, eng, 0, 3)
    bd.save_checkpoint(path, **eng.checkpoint_state(), step=3, async_=True).wait()  # written while it trains on
    return _continue(ctx, eng, 3, 5)


def _load(path, tp, engine, resave=None, replicate=1):
    ctx, eng = _engine(tp, engine, seed=5, replicate=replicate)
    bd.load_checkpoint(path, **eng.checkpoint_state())
    if resave:
        bd.save_checkpoint(resave, **eng.checkpoint_state(), step=3)
    return _continue(ctx, eng, 3, 5)


def _one_process_state(path):
    _, eng = _engine(1, "ddp", seed=5)
    bd.load_checkpoint(path, **eng.checkpoint_state())
    state = {f"model/{k}": v.clone() for k, v in eng.model.state_dict().items()}
    names = {id(p): n for n, p in eng.model.named_parameters()}
    for p, entry in eng.optimizer.state.items():
        state.update({f"optim/{names[id(p)]}/{k}": v.clone() for k, v in entry.items()})
    return state


@pytest.mark.slow
def test_fsdp_checkpoint_loads_bit_exactly_at_every_layout_and_engine_and_back(tmp_path):
    saved = tmp_path / "fsdp" / "step_3"
    continued = run_ranks(_save_fsdp, 4, saved)[0]
    # Resumed at the same layout: bit-identical losses.
    assert run_ranks(_load, 4, saved, 2, "fsdp") == [continued] * 4
    copies = {
        "FSDP tp=1 x dp=4": run_ranks(_load, 4, saved, 1, "fsdp", tmp_path / "a" / "step_3"),
        "HSDP tp=1 x (2 x 2)": run_ranks(_load, 4, saved, 1, "fsdp", tmp_path / "b" / "step_3", 2),
        "DDP tp=2 x dp=1": run_ranks(_load, 2, saved, 2, "ddp", tmp_path / "c" / "step_3"),
        "DeepSpeed ZeRO-1 tp=2 x dp=2": run_ranks(_load, 4, saved, 2, "deepspeed", tmp_path / "d" / "step_3"),
    }
    # ... and back: FSDP at tp=2 x dp=2 from what DeepSpeed saved.
    back = run_ranks(_load, 4, tmp_path / "d" / "step_3", 2, "fsdp", tmp_path / "e" / "step_3")
    for name, losses in copies.items():  # the same weights and state: the same next steps, to rounding
        np.testing.assert_allclose(losses[0], continued, rtol=FP32["loss"], err_msg=name)
    assert back == [continued] * 4
    reference = _one_process_state(saved)
    assert any(k.endswith("exp_avg_sq") for k in reference)
    for copy in "abcde":
        state = _one_process_state(tmp_path / copy / "step_3")
        assert state.keys() == reference.keys(), copy
        for key, value in reference.items():
            assert torch.equal(state[key], value), (copy, key)


def _skip_and_stats(engine_kind, poison):
    """One step whose loss is NaN on DP rank 1 (``poison``), then a clean one; the dense-layer
    statistics after the clean step."""
    from bigdense.train.metrics import DenseLayerStats

    ctx, eng = _engine(1, engine_kind, steps=4)
    stats = DenseLayerStats(eng.model, ctx.tp_group)
    first = eng.train_step(_micro_batches(ctx, eng, 0))
    if poison:
        with torch.no_grad():  # this rank's slice of the weight
            getattr(eng.model.ln_f.weight, "_local_tensor", eng.model.ln_f.weight)[0] = (
                float("nan") if ctx.dp_rank == 1 else 1.0)
    before = {n: getattr(p, "full_tensor", lambda p=p: p)().clone() for n, p in eng.model.named_parameters()}
    second = eng.train_step(_micro_batches(ctx, eng, 1))
    after = {n: getattr(p, "full_tensor", lambda p=p: p)().clone() for n, p in eng.model.named_parameters()}
    stats.capture = True
    eng.train_step(_micro_batches(ctx, eng, 2))
    return first.skipped, second.skipped, before, after, stats.collect()


def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere_and_stats_see_the_whole_tensor():
    """The skip vote under FSDP: a NaN in DP rank 1's slice of ln_f.weight makes the loss, hence
    every gradient slice, non-finite; every rank skips and every weight stays as it was. The dense-layer RMS of an
    FSDP-sharded weight sums its DP slices: the DDP engine's numbers (fp32 regrouping only)."""
    for first, second, before, after, _ in run_ranks(_skip_and_stats, 2, "fsdp", True):
        assert (first, second) == (False, True)
        assert torch.isnan(after["ln_f.weight"]).sum() == 1
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
    fsdp = run_ranks(_skip_and_stats, 2, "fsdp", False)
    ddp = run_ranks(_skip_and_stats, 2, "ddp", False)
    for (*_, stats), (*_, reference) in zip(fsdp, ddp):
        assert stats.keys() == reference.keys() and any("grad" in k for k in stats)
        for key, value in stats.items():
            assert abs(value - reference[key]) <= 1e-5 * reference[key], (key, value, reference[key])


def _first_step_allocations():
    from torch.distributed.fsdp import fully_shard

    from bigdense.train.engines.fsdp import register_tensor_lr_meta

    ctx = bd.init_parallel(tp=1)
    register_tensor_lr_meta()
    layer = nn.Linear(1024, 1024, bias=False)  # 4 MiB, 2 MiB per rank
    fully_shard(layer, mesh=ctx.mesh["dp"])
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)  # as the engines set it: a tensor, no host sync
    layer(torch.ones(2, 1024)).sum().backward()
    with torch.profiler.profile(profile_memory=True) as prof:
        opt.step()
    return sum(e.cpu_memory_usage for e in prof.events() if e.name == "aten::zeros_like")


def test_the_first_fused_adamw_step_on_dtensors_allocates_no_global_sized_tensor():
    """torch 2.13 has no meta kernel for fused AdamW with a tensor LR: DTensor's first dispatch would
    run it on zero-filled tensors of the global shapes (parameter, gradient, both moments: 4 x 4 MiB
    here; measured 24 MiB of zeros_like in all). The engine registers one (`register_tensor_lr_meta`);
    what remains is the two moments' first allocation, of local size (2 MiB each), which the
    profiler reports at the DTensor and at the local level: 8 MiB."""
    for zeros in run_ranks(_first_step_allocations, 2):
        assert zeros <= 4 * 2 * 2**20, zeros
