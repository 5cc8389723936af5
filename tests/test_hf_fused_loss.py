"""`CausalLM` computes a Hugging Face model's loss through bigdense's fused vocab-parallel head: the loss
and every parameter's gradient equal plain transformers' (the unconverted model's own logits and
F.cross_entropy) at tp 1, 2 and 3 (uneven vocabulary shards), for architectures with each kind of
logit transform -- none (Llama), Gemma 2's softcap, Gemma 3 with one, Cohere's logit scale, Granite's
logits scaling, Qwen2 with tied embeddings, Phi's head bias, and an MoE (Qwen3-MoE) -- with the
output head's own forward never called; a model whose head is more than a linear map keeps its
logits, and says why.

Tolerance: the fused loss sums the same fp32 terms as F.cross_entropy in another order (chunked,
sharded, a scale applied to the hidden states rather than the logits): a few ulps; `compare_fused_loss`'s
diffs are held to 1e-5 of each tensor's magnitude (floored at 1e-3 of the largest gradient, as the
conversion checks are).
"""
import pytest
import torch

import bigdense as bd
from bigdense.testing import run_ranks
from bigdense.testing.check import beyond, compare_fused_loss

pytest.importorskip("transformers")

# model_type, config overrides, the transform the model's forward applies
CASES = {
    "llama": ({}, "none"),
    "gemma2": ({}, "softcap 30"),
    "gemma3_text": ({"final_logit_softcapping": 15.0}, "softcap 15"),
    "cohere": ({}, "logits x 0.0625"),
    "granite": ({"logits_scaling": 8.0}, "logits x 0.125"),
    "qwen2": ({"tie_word_embeddings": True}, "none"),
    "phi": ({}, "none"),
    "qwen3_moe": ({}, "none"),
}
RTOL = 1e-5


def _batch(vocab: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, vocab, (2, 12), generator=g)
    y = torch.randint(0, vocab, (2, 12), generator=g)
    y[0, :4] = -100
    return x, y


def _fused_equals_plain(model_type: str, tp: int):
    from bigdense.models import CausalLM
    from bigdense.testing.hf_models import build_tiny

    overrides, transform = CASES[model_type]
    bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    reference = build_tiny(model_type, **overrides)
    torch.manual_seed(0)
    lm = build_tiny(model_type, **overrides)
    model = CausalLM(bd.parallelize(lm) if tp > 1 else lm)
    path = model.prepare_loss()
    assert path.fused and path.transform.describe() == transform, (model_type, path.describe())
    head = lm.get_output_embeddings()
    if model_type == "qwen2":
        assert head.weight is lm.get_input_embeddings().weight  # tied, shard for shard
    if model_type == "phi":
        assert head.bias is not None
    own_forward = type(head).forward

    def guarded(self, *args, **kwargs):  # the head's own forward (its matmul) must not run in a step
        assert self is not head, "the output head's own forward ran in a training step"
        return own_forward(self, *args, **kwargs)

    type(head).forward = guarded
    try:
        diffs = compare_fused_loss(reference, model, *_batch(reference.config.get_text_config().vocab_size))
    finally:
        type(head).forward = own_forward
    return diffs


@pytest.mark.parametrize("tp", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_type", list(CASES))
def test_fused_loss_and_gradients_equal_plain_transformers(model_type, tp):
    for rank, diffs in enumerate(run_ranks(_fused_equals_plain, tp, model_type, tp, timeout=300)):
        assert len(diffs) > 5, diffs  # the loss and the model's gradients
        assert not beyond(diffs, RTOL), (model_type, tp, rank, beyond(diffs, RTOL))


def _path_of(model_type: str):
    from bigdense.models import CausalLM
    from bigdense.testing.hf_models import build_tiny

    bd.init_parallel(tp=1)
    torch.manual_seed(0)
    return CausalLM(build_tiny(model_type)).prepare_loss()


def test_a_head_that_is_more_than_a_linear_map_keeps_its_logits_and_says_why():
    path = run_ranks(_path_of, 1, "dory")[0]  # DoryLMHead: a learned per-class logit scale inside the head
    assert not path.fused
    assert "DoryLMHead" in path.reason and "logit_scale" in path.reason, path.reason
    assert path.describe().startswith("gathered logits: ")


def _gathered_when_asked():
    from bigdense.models import CausalLM
    from bigdense.testing.hf_models import build_tiny

    bd.init_parallel(tp=1)
    torch.manual_seed(0)
    reference = build_tiny("llama")
    torch.manual_seed(0)
    model = CausalLM(build_tiny("llama"), fused_loss=False)
    assert not model.prepare_loss().fused
    return compare_fused_loss(reference, model, *_batch(reference.config.vocab_size))


def test_fused_loss_false_keeps_the_models_own_logits():
    diffs = run_ranks(_gathered_when_asked, 1)[0]
    assert not beyond(diffs, RTOL)


def _train_fused(kind: str, tp: int, compile_model: bool = False, model_type: str = "gemma2"):
    """Three steps of ``model_type`` (Gemma 2: its softcap on the fused path, its head tied; Llama:
    untied, so its head is an FSDP unit of its own) through an engine, on the layout asked for; the
    step losses and the tokens counted."""
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig, RecomputeConfig
    from bigdense.models import CausalLM
    from bigdense.testing.hf_models import build_tiny
    from bigdense.train.compile import apply_compile
    from bigdense.train.recompute import apply_recompute

    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    lm = build_tiny(model_type)
    model = CausalLM(bd.parallelize(lm) if tp > 1 else lm)
    assert model.prepare_loss().fused
    if compile_model:  # as the job orders them: recompute around the blocks, then the whole model compiled
        apply_recompute(model.blocks, RecomputeConfig(mode="full"))
        apply_compile(model, "model", "aot_eager", stage="after_recompute")
    rows = 4 // ctx.dp_size
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=kind, zero_stage=1),
                             optim_cfg=OptimConfig(lr=1e-3, warmup_steps=0), precision_cfg=PrecisionConfig(dtype="fp32"),
                             micro_batch_size=rows, grad_accum=1, max_steps=3)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        x, y = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
        y[1, :6] = -100
        mine = slice(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows)
        result = engine.train_step([(x[mine], y[mine])])
        out.append((result.loss, result.tokens))
    return out


@pytest.mark.parametrize("kind, world, tp, compile_model, model_type", [
    ("ddp", 2, 1, False, "gemma2"), ("fsdp", 2, 1, False, "gemma2"), ("fsdp", 2, 1, False, "llama"),
    ("ddp", 2, 2, True, "gemma2"), pytest.param("deepspeed", 2, 1, False, "gemma2", marks=pytest.mark.slow)],
    ids=["ddp-dp2", "fsdp-dp2", "fsdp-dp2-untied-head", "tp2-compile-model-recompute", "deepspeed-dp2"])
def test_every_engine_trains_the_fused_loss_as_one_process_does(kind, world, tp, compile_model, model_type):
    # Against one process (whose loss and gradients are plain transformers', above): DP averages
    # half-batch gradients, TP splits sums, compile reorders none -- fp32 rounding, which Adam's
    # first steps may carry: 1e-6 relative over three steps. FSDP frees the head's gathered shards
    # after its forward and gathers them again before its backward, which the fused loss, formed in
    # the head's forward, must not run ahead of (the untied Llama head crashed the process so).
    want = run_ranks(_train_fused, 1, "ddp", 1, False, model_type)[0]
    for rank in run_ranks(_train_fused, world, kind, tp, compile_model, model_type, timeout=600):
        for (loss, tokens), (want_loss, want_tokens) in zip(rank, want):
            assert tokens == want_tokens == 4 * 16 - 6
            assert abs(loss - want_loss) <= 1e-6 * want_loss, (kind, rank, want)
