"""The memory planner with low-rank adapters (``lora.r`` > 0): the factors' exact counts per rank,
gradients and optimizer state of the adapters alone, the adapters' activations and collectives.

Counts are exact (integers): the planner's per-rank parameter, gradient and optimizer bytes equal
the tensors the job's own model and engine hold after a step (`parallelize_model` adds the
adapters, `bigdense.jobs.parallelize.apply_adapters`), for the reference GPT and for a Hugging Face
decoder converted at tp=2 (its adapters split as on the converted layers). The peak is held against
the measured one (`measure_config`, live tensor bytes) to the GPT planner's `PEAK_TOL`.
"""
import pytest
import torch
from omegaconf import OmegaConf

import bigdense as bd
from bigdense.config import PlanConfig
from bigdense.plan.__main__ import DEFAULT_CONF, compose, main
from bigdense.plan.config import estimate_config
from bigdense.plan.estimate import adapters
from bigdense.plan.measure import measure_config, optimizer_tensors
from bigdense.testing import run_ranks
from bigdense.testing.hf_models import tiny_config

PEAK_TOL = 0.005  # tests/test_plan.py's
GPT = ["model=gpt_tiny", "parallel.tp=2", "data.micro_batch_size=4", "data.seq_len=64"]
HF_SHAPE = dict(hidden_size=128, intermediate_size=352, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, vocab_size=512, max_position_embeddings=256)


def _plan(**kw):
    return OmegaConf.merge(OmegaConf.structured(PlanConfig), OmegaConf.create({"device_type": "cpu", **kw}))


def _estimate(overrides):
    return estimate_config(compose(overrides, DEFAULT_CONF), _plan())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _state_after_a_step(overrides):
    """This rank's bytes of parameters, gradients and optimizer state (AdamW's moments; its step
    counters, a scalar per parameter, the planner leaves out) after one training step of the job's
    model and engine (random weights for a Hugging Face model)."""
    from bigdense.jobs import build_gpt, build_hf, parallelize_model
    from bigdense.layers.base import allocate_empty

    cfg = compose(overrides, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=int(cfg.parallel.tp))
    torch.manual_seed(0)
    if cfg.model.name == "hf":
        model, vocab = build_hf(cfg), 512
        with torch.no_grad():
            for p in allocate_empty(model, ctx.device).parameters():
                p.normal_(0.0, 0.02)
    else:
        model, vocab = build_gpt(cfg, cfg.data.vocab_size, ctx), cfg.data.vocab_size
    engine = parallelize_model(model, ctx, cfg, load_pretrained=False).engine
    b, s = cfg.data.micro_batch_size, cfg.data.seq_len
    engine.train_step([(torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s)))])
    params = list(model.parameters())
    moments = [t for t in optimizer_tensors(engine.optimizer) if t.dim() > 0]  # (not AdamW's step scalars)
    return _nbytes(params), _nbytes(p.grad for p in params if p.grad is not None), _nbytes(moments)


def _check_state(overrides):
    est = _estimate(overrides)
    for params, grads, optimizer in run_ranks(_state_after_a_step, 2, overrides, timeout=300):
        assert (est.bytes_per_rank["params"], est.bytes_per_rank["grads"], est.bytes_per_rank["optimizer"]) == (
            params, grads, optimizer), overrides
    return est


def test_gpt_state_per_rank_is_exact():
    est = _check_state(GPT + ["lora.r=4"])
    full = _estimate(GPT)
    assert est.params_per_rank == full.params_per_rank + est.trainable_per_rank  # the factors, beside the base
    # qkv, out, up, down of 4 blocks; A (r x in) and B (out x r) each
    assert est.trainable_params == 4 * 4 * (256 + 768 + 256 + 256 + 256 + 1024 + 1024 + 256)
    assert est.total_params == full.total_params + est.trainable_params


def test_hf_state_per_rank_is_exact(tmp_path):
    tiny_config("llama", **HF_SHAPE).save_pretrained(tmp_path)
    hf = ["model=hf", f"model.path={tmp_path}", "parallel.tp=2", "data.vocab_size=512", "data.micro_batch_size=2",
          "data.seq_len=16"]
    # Packed and plain column layers, row layers, a subset of them: the adapters split as on the
    # converted layers (the meta model's layers are not converted).
    _check_state(hf + ["lora.r=4", "lora.targets=[q_proj,v_proj,down_proj]"])


def test_peak_and_its_parts_against_full_fine_tuning():
    lora, full = _estimate(GPT + ["lora.r=4"]), _estimate(GPT)
    state = ("grads", "optimizer")
    saved = sum(full.bytes_per_rank[k] - lora.bytes_per_rank[k] for k in state)
    assert 0 < sum(lora.bytes_per_rank[k] for k in state) < 0.01 * saved
    # The peak drops by the gradients and optimizer state, and by the head's weight gradient the
    # fused loss no longer forms (the tied embedding is frozen): more than `saved`, at most twice.
    assert saved < full.peak_bytes - lora.peak_bytes < 2 * saved
    # Each adapted layer keeps z = A x, tokens x r (fp32 here), beyond what its layer keeps.
    tokens, layers = 4 * 64, 16
    assert lora.bytes_per_rank["activations"] - full.bytes_per_rank["activations"] >= layers * tokens * 4 * 4 - (
        full.activations_per_layer[0][1])  # less the frozen embedding's output, which nothing keeps


def test_tp_collectives_add_one_per_adapted_layer():
    for sp in ("false", "true"):
        overrides = GPT + [f"parallel.sequence_parallel={sp}"]
        lora, full = _estimate(overrides + ["lora.r=8"]), _estimate(overrides)
        assert len(adapters(*_meta_and_entries(overrides + ["lora.r=8"]), 2)) == 16
        assert lora.tp_collective_bytes - full.tp_collective_bytes == 16 * (4 * 64) * 8 * 4


def _meta_and_entries(overrides):
    from bigdense.plan.config import meta_model
    from bigdense.plan.count import param_entries

    model = meta_model(compose(overrides, DEFAULT_CONF))
    return model, param_entries(model, None, 2)


def test_peak_memory_measured():
    overrides = GPT + ["lora.r=4"]
    est = _estimate(overrides)
    for m in run_ranks(_measure, 2, overrides, timeout=300):
        assert abs(est.peak_bytes - m) <= PEAK_TOL * m, (est.peak_bytes, m, est.phases)


def _measure(overrides):
    return measure_config(compose(overrides, DEFAULT_CONF))["peak_bytes"]


def test_hf_peak_memory_measured(tmp_path):
    # The Hugging Face activation model under adapters (frozen norms keep no normalised values, each
    # adapter its z), against one process's measured step: within test_plan_hf.py's 1%.
    tiny_config("llama", **HF_SHAPE).save_pretrained(tmp_path)
    overrides = ["model=hf", f"model.path={tmp_path}", "data.vocab_size=512", "data.micro_batch_size=4",
                 "data.seq_len=64", "lora.r=4"]
    est, measured = _estimate(overrides), _measure(overrides)
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured, est.phases)


def test_cli_prints_what_trains(capsys):
    assert main(["model=gpt_small", "lora.r=8", "parallel.tp=2"]) == 0
    printed = capsys.readouterr().out
    # 12 blocks of qkv, out, up, down at r=8: 12 * 8 * (768 + 2304 + 768 + 768 + 768 + 3072 + 3072 + 768)
    assert "trainable                1.2M of 112M (1.05%)" in printed, printed
    assert "TP collectives per step" in printed


def test_frozen_base_held_in_bf16_is_counted_at_its_width():
    # lora.base_dtype=bf16: the adapted layers' frozen weights at 2 bytes, the rest at the layout's.
    est = _check_state(GPT + ["lora.r=4", "precision=bf16", "lora.base_dtype=bf16"])
    assert est.bytes_per_rank["params"] < _estimate(GPT + ["lora.r=4", "precision=bf16"]).bytes_per_rank["params"]
