"""torch.compile(fullgraph=True) of the hot path at tp=2 on gloo: no graph break, equal to eager.

``fullgraph=True`` turns any graph break into an error, so compiling is the break count's test.
The ``aot_eager`` backend traces forward and backward through dynamo and AOTAutograd exactly as
inductor would, then runs the traced aten ops (no C++ compiler needed on CPU). The random key of
each dropout is drawn by a traced ``randint`` from the CPU generator, so the compiled module
draws the same masks as eager after the same ``torch.manual_seed``.

Under ``trainer.compile=blocks`` the steps with host checks on run the blocks eagerly (the sequence
shares' exchange is read on the host: compiled, a graph break), and no functional collective may be
left unwaited by the step after them either (torch's registry of them, reported at exit as
"unwaited collective calls").
"""
import pytest
import torch

import bigdense as bd
from bigdense.models.gpt import Block, GPTConfig
from bigdense.testing import run_ranks

from helpers import assert_close

# The traced graph runs the same aten ops on the same inputs; only AOTAutograd's reordering of
# independent ops can change a summation order: a few ulps.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _modules(ctx):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=37, d_model=16, n_heads=4, dropout=0.1, attention_dropout=0.1)
    x = torch.randn(2, 5, 16)
    ids = torch.randint(0, 37, (2, 5))
    target = torch.randint(0, 37, (2, 5))
    target[0, 1] = -100
    head = bd.ParallelClassifierHead(16, 37, chunk_size=4)
    return {
        "GPT block (dropout and invariant attention dropout)": (Block(cfg, ctx.tp_group), (x,)),
        "ParallelMLP with dropout": (bd.ParallelMLP(16, 40, dropout=0.1), (x,)),
        "VocabParallelEmbedding": (bd.VocabParallelEmbedding(37, 16), (ids,)),
        "ParallelClassifierHead.loss": (head.loss, (x, target)),
    }


def _run(fn, args, seed):
    args = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    torch.manual_seed(seed)
    out = fn(*args)
    out.float().square().sum().backward()
    return out.detach(), [a.grad for a in args if a.is_floating_point()]


def _compiled_equals_eager(tp):
    ctx = bd.init_parallel(tp=tp)
    results = {}
    with bd.set_checks(False):
        for name, (fn, args) in _modules(ctx).items():
            params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else list(fn.__self__.parameters())
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            for step in range(2):  # a second call reuses the graph: new dropout masks, no recompile
                eager_out, eager_grads = _run(fn, args, seed=step)
                eager_params = [p.grad.clone() for p in params]
                for p in params:
                    p.grad = None
                out, grads = _run(compiled, args, seed=step)
                assert_close(out, eager_out, f"{name} step {step} output", **FP32)
                for g, ref in zip(grads + [p.grad for p in params], eager_grads + eager_params):
                    assert_close(g, ref, f"{name} step {step} gradient", **FP32)
                for p in params:
                    p.grad = None
            results[name] = True
    return results


@pytest.mark.slow
def test_hot_path_compiles_without_graph_breaks_and_equals_eager_at_tp2():
    for rank in run_ranks(_compiled_equals_eager, 2, 2, timeout=600):
        assert all(rank.values()) and len(rank) == 4


def _trainer_compile_equals_eager(tp, sequence_parallel):
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.models.gpt import GPT
    from bigdense.train.compile import compile_blocks
    from bigdense.train.engines import EngineSettings, build_engine

    ctx = bd.init_parallel(tp=tp)
    cfg = GPTConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, max_seq_len=6, dropout=0.1,
                    attention_dropout=0.1, head_chunk_size=5, sequence_parallel=sequence_parallel)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(3))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg, tp_group=ctx.tp_group)
        if compiled:
            torch._dynamo.reset()
            compile_blocks(model.blocks, "aot_eager")  # as trainer.compile=true does
        settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(warmup_steps=1), precision=PrecisionConfig(),
                                  micro_batch_size=2, max_steps=10)
        engine = build_engine(model, ctx, settings)
        with bd.set_checks(False):
            losses[compiled] = [engine.train_step([(idx, idx.roll(-1, dims=1))]).loss for _ in range(3)]
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_trainer_compile_trains_like_eager_at_tp2(sequence_parallel):
    # Three engine steps (dropout masks, AdamW updates) through compiled blocks: the same losses
    # up to summation order (1e-5 relative, as above). With sequence parallelism the engine's
    # deferral of the norms' and biases' gradient sums is traced into the compiled blocks.
    for losses in run_ranks(_trainer_compile_equals_eager, 2, 2, sequence_parallel, timeout=600):
        assert losses[True] == pytest.approx(losses[False], rel=1e-5), losses


def _checked_then_unchecked_blocks_step(tp):
    """The loop's order under ``trainer.compile=blocks`` with sequence parallelism: a step with host
    checks on, then one with them off; the functional collectives left unwaited after each."""
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.models.gpt import GPT
    from bigdense.train.compile import compile_blocks
    from bigdense.train.engines import EngineSettings, build_engine

    ctx = bd.init_parallel(tp=tp)
    cfg = GPTConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=4, max_seq_len=6, head_chunk_size=5,
                    sequence_parallel=True)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=ctx.tp_group)
    torch._dynamo.reset()
    compile_blocks(model.blocks, "aot_eager")
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(warmup_steps=1), precision=PrecisionConfig(),
                              micro_batch_size=2, max_steps=10)
    engine = build_engine(model, ctx, settings)
    unwaited = []
    for checked in (True, False):
        with bd.set_checks(checked):
            engine.train_step([(idx, idx.roll(-1, dims=1))])
        unwaited.append(torch._C._distributed_c10d._get_work_registry_size())
    return unwaited


def test_blocks_compile_leaves_no_collective_unwaited_in_checked_steps_with_sp_at_tp2():
    # Tracing the sequence shares' exchange (`comm.all_gather_sizes`) with a constant input to
    # Dynamo would run the all-gather for real and leave it unwaited (12 per rank with this block,
    # from `torch.tensor([length])`, when the checked step was compiled too).
    for rank in run_ranks(_checked_then_unchecked_blocks_step, 2, 2, timeout=300):
        assert rank == [0, 0], rank
