"""Mixture-of-experts Hugging Face models (tiny Mixtral and Qwen3-MoE built from their configs,
nothing downloaded) converted by their own plans (replicated routers; Qwen3's per-head norms
`replicated_with_grad_allreduce`; the experts by the tensor-parallel plan's `moe_tp_experts` and
`packed_colwise` up to transformers 5.24, by the expert-parallel plan's whole experts per rank
from 5.25, which no longer names them in the tensor-parallel plan) train through the DDP engine
exactly as their unconverted twins do, at tp=2 and tp=2 x dp=2, and their checkpoints reshard.

Every layout sees the same global micro-batches; DP rank d takes rows [d*B, (d+1)*B). The reference
is the unconverted model in one process (tp=1, dp=1, the same engine). Tolerance, fp32: rtol 2e-5
on losses and gradient norms, as tests/test_engine.py explains (sums over ranks reorder fp32
additions; four AdamW steps carry the last bits into the updates); a wrong slice of an expert, a
router that decided differently on two ranks or an unsummed gradient moves the loss by 1e-3 or more.
"""
import pytest
import torch

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.models import CausalLM
from bigdense.testing import run_ranks

from helpers import assert_close

pytest.importorskip("transformers")

G, T, STEPS, ACCUM = 4, 8, 4, 2
OPTIM = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, grad_clip=1.0)
TOL = dict(rtol=2e-5, atol=0.0)
MODELS = ["mixtral", "qwen3_moe"]


def _batches(step):
    g = torch.Generator().manual_seed(700 + step)
    return [(torch.randint(3, 240, (G, T), generator=g), torch.randint(3, 240, (G, T), generator=g))
            for _ in range(ACCUM)]


def _train(model_type, convert=True, save_to=None, engine_cfg=EngineConfig(kind="ddp")):
    from bigdense.testing.hf_models import build_tiny

    ctx = bd.get_default_context()
    B = G // ctx.dp_size
    rows = slice(ctx.dp_rank * B, (ctx.dp_rank + 1) * B)
    torch.manual_seed(0)
    lm = build_tiny(model_type)
    if convert:
        bd.parallelize(lm, tp_group=ctx.tp_group)
    model = CausalLM(lm)
    engine = bd.build_engine(model, ctx, engine_cfg=engine_cfg, optim_cfg=OPTIM,
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=B, grad_accum=ACCUM,
                             max_steps=STEPS)
    out = []
    for step in range(STEPS):
        r = engine.train_step([(x[rows], y[rows]) for x, y in _batches(step)])
        out.append((r.loss, r.grad_norm, r.skipped))
    if save_to is not None:
        bd.save_checkpoint(save_to, **engine.checkpoint_state(), step=STEPS)
    if not convert:  # the reference's weights and AdamW moments too
        state = engine.optimizer.state
        return out, {n: (p.detach().clone(), state[p]["exp_avg"].clone()) for n, p in model.named_parameters()}
    return out


def _on_mesh(tp, model_type, save_to=None, engine_cfg=EngineConfig(kind="ddp")):
    bd.init_parallel(tp=tp)
    return _train(model_type, save_to=save_to, engine_cfg=engine_cfg)


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_moe_model_trains_through_the_ddp_engine_like_its_unconverted_twin(model_type, world, tp):
    reference, _ = _train(model_type, convert=False)
    for rank, run in enumerate(run_ranks(_on_mesh, world, tp, model_type, timeout=300)):
        for step, ((loss, norm, skipped), (rloss, rnorm, _)) in enumerate(zip(run, reference)):
            assert not skipped
            assert_close(torch.tensor(loss), torch.tensor(rloss), f"rank {rank} step {step} loss", **TOL)
            assert_close(torch.tensor(norm), torch.tensor(rnorm), f"rank {rank} step {step} grad norm", **TOL)


def _load_at(tp, model_type, path):
    """This rank's model tensors and AdamW moments after loading ``path`` at ``tp``."""
    from bigdense.layers.base import named_shard_specs
    from bigdense.testing.hf_models import build_tiny

    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = CausalLM(bd.parallelize(build_tiny(model_type), tp_group=ctx.tp_group))
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OPTIM,
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=G, grad_accum=1,
                             max_steps=STEPS)
    bd.load_checkpoint(path, **engine.checkpoint_state())
    specs = named_shard_specs(model)
    state = engine.optimizer.state
    return {name: (p.detach().clone(), state[p]["exp_avg"].clone(), specs.get(name))
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", MODELS)
def test_moe_checkpoint_saved_at_tp2_x_dp2_loads_bit_exactly_at_tp1_and_tp3(model_type, tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(_on_mesh, 4, 2, model_type, path, timeout=300)
    full = run_ranks(_load_at, 1, 1, model_type, path, timeout=300)[0]  # one process: every tensor whole
    for rank, shards in enumerate(run_ranks(_load_at, 3, 3, model_type, path, timeout=300)):
        # At tp=3 the 4 heads do not divide: attention stays whole, experts and MLPs split 3 ways
        # (unevenly: the experts' intermediate size, each packed half of gate_up_proj on its own, up
        # to transformers 5.24; the 4 experts themselves from 5.25).
        split = [n for n, (_, _, spec) in shards.items() if spec is not None]
        assert any("experts.gate_up_proj" in n for n in split), split
        for name, (param, moment, spec) in shards.items():
            want_param, want_moment, _ = full[name]
            if spec is not None:
                want_param, want_moment = spec.slice_of(want_param), spec.slice_of(want_moment)
            assert torch.equal(param, want_param), (rank, name)
            assert torch.equal(moment, want_moment), (rank, name)


@pytest.mark.slow
def test_deepspeed_zero1_trains_a_moe_model_and_its_packed_fragments_reshard(tmp_path):
    """DeepSpeed's ZeRO-1 partitions (flat fragments of each DP rank, which cut across the packed
    [gate; up] halves of an expert's weight) save and load like the DDP engine's state."""
    path = tmp_path / "ckpt"
    reference, reference_state = _train("qwen3_moe", convert=False)
    zero1 = EngineConfig(kind="deepspeed", zero_stage=1)
    for rank, run in enumerate(run_ranks(_on_mesh, 4, 2, "qwen3_moe", path, zero1, timeout=300)):
        for step, ((loss, _, _), (rloss, _, _)) in enumerate(zip(run, reference)):
            assert_close(torch.tensor(loss), torch.tensor(rloss), f"rank {rank} step {step} loss", **TOL)
    full = run_ranks(_load_at, 1, 1, "qwen3_moe", path, timeout=300)[0]
    # The weights and moments DeepSpeed saved from its fragments are the unconverted run's, in their
    # places: a fragment put in the wrong packed half would swap gate and up moments (values of
    # order 1e-3), and their weights by the updates of four steps (order lr = 3e-3). Allowed: the
    # fp32 round-off of four AdamW steps, up to 5e-5 where a gradient below Adam's eps (1e-8) makes
    # its first update a tenth of lr or so, which its last bits move: measured 2.6e-5 at
    # lm_head.weight[128, 0], whose first gradient is -6.2e-9 (see the module docstring).
    for name, (param, moment, _) in full.items():
        assert_close(param, reference_state[name][0], f"{name} after loading", rtol=1e-4, atol=5e-5)
        assert_close(moment, reference_state[name][1], f"{name} exp_avg after loading", rtol=1e-3, atol=1e-6)
    for rank, shards in enumerate(run_ranks(_load_at, 2, 2, "qwen3_moe", path, timeout=300)):
        for name, (param, moment, spec) in shards.items():
            want_param, want_moment, _ = full[name]
            if spec is not None:
                want_param, want_moment = spec.slice_of(want_param), spec.slice_of(want_moment)
            assert torch.equal(param, want_param) and torch.equal(moment, want_moment), (rank, name)


def _local_numel(model_type):
    from bigdense.testing.hf_models import build_tiny

    bd.init_parallel(tp=3)
    torch.manual_seed(0)
    model = bd.parallelize(build_tiny(model_type))
    return sum(p.numel() for p in model.parameters())  # each parameter once (tied ones too)


@pytest.mark.parametrize("model_type", MODELS)
def test_the_planner_counts_a_converted_moe_model_exactly(model_type):
    """`bd.plan.estimate` of the plain model on the meta device counts, per rank, what
    `parallelize` will leave there: packed experts split block by block, attention whole where its
    heads do not divide (tp=3)."""
    from bigdense.testing.hf_models import build_tiny

    with torch.device("meta"):
        model = build_tiny(model_type)
    est = bd.plan.estimate(model, tp=3)
    assert est.params_per_rank == max(run_ranks(_local_numel, 3, model_type))


def _partial_grad_names():
    from bigdense.parallel.partial_grads import partial_grad_params
    from bigdense.testing.hf_models import build_tiny

    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = bd.parallelize(build_tiny("qwen3_moe"))
    ids = {id(p): n for n, p in model.named_parameters()}
    return sorted(ids[id(p)] for p, _ in partial_grad_params(model))


def test_per_head_norms_are_the_partial_gradients_the_ddp_engine_sums_once_per_step():
    """Qwen3's q/k norms (`replicated_with_grad_allreduce`) see this rank's heads only: the DDP
    engine sums their gradients with the sequence-parallel ones, in one all-reduce per step."""
    names = run_ranks(_partial_grad_names, 2)[0]
    assert names == sorted(f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("k_norm", "q_norm"))
