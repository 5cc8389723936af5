"""Dense-layer RMS statistics describe the unsharded model: the same numbers at tp=1 and tp=2."""
import json

import torch

import bigdense as bd
from bigdense.models import GPT, GPTConfig
from bigdense.testing import run_ranks
from bigdense.train.metrics import DenseLayerStats, MetricsLog, plot_loss_curve


def _stats(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, d_model=32, n_layers=1, n_heads=2, max_seq_len=8, dropout=0.0),
                tp_group=ctx.tp_group)
    stats = DenseLayerStats(model, ctx.tp_group)
    stats.capture = True
    idx = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    return stats.collect()


def test_rms_statistics_are_those_of_the_unsharded_model():
    reference = _stats(1)
    # Every dense layer's weight and grad; activations in and out, sharded ones included.
    for key in ("blocks.0.attn.qkv/act", "blocks.0.attn.out/act_in", "blocks.0.mlp/act_in", "head/act_in",
                "head/grad", "tok_emb/act", "blocks.0.mlp.up/weight"):
        assert reference[f"rms/{key}"] > 0, key
    for rank, stats in enumerate(run_ranks(_stats, 2, 2)):
        assert stats.keys() == reference.keys()
        for key, value in stats.items():
            # Sums of squares regrouped over two ranks: fp32 rounding only.
            assert abs(value - reference[key]) <= 1e-5 * reference[key], (rank, key, value, reference[key])


def test_metrics_log_and_loss_curve(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    for step, loss in ((10, 5.0), (20, 4.0)):
        log.write({"kind": "train", "step": step, "loss": loss})
    log.write({"kind": "eval", "step": 20, "eval_loss": 4.2})
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["train", "train", "eval"]
    assert plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png").stat().st_size > 1000
    assert not MetricsLog(tmp_path / "nope", enabled=False).enabled  # other ranks write nothing
