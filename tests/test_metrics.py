"""Dense-layer RMS statistics describe the unsharded model: at tp=1 they equal a direct computation
on the tensors (recorded here with the test's own hooks), and tp=2 gives the same numbers."""
import json
import math

import pytest
import torch

import bigdense as bd
from bigdense.models import GPT, GPTConfig
from bigdense.testing import run_ranks
from bigdense.train.metrics import DenseLayerStats, MetricsLog, plot_loss_curve


def _rms(t):
    return math.sqrt(t.detach().double().square().mean().item())


def _stats(tp, direct=None, sequence_parallel=False):
    """The statistics at ``tp``; with a ``direct`` dict (tp=1 only) also fill it with the RMS of the
    same tensors computed here: weights and gradients read off the parameters, activations taken
    by this test's own hooks on every dense layer (input and non-scalar output)."""
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, d_model=32, n_layers=1, n_heads=2, max_seq_len=8, dropout=0.0,
                          sequence_parallel=sequence_parallel), tp_group=ctx.tp_group)
    stats = DenseLayerStats(model, ctx.tp_group)
    dense = {name: m for name, m in model.named_modules()
             if isinstance(m, (bd.TensorParallelModule, torch.nn.Linear, torch.nn.Embedding))}
    if direct is not None:
        for name, m in dense.items():
            def record(mod, inputs, out, name=name):
                if inputs and inputs[0].is_floating_point():
                    direct[f"rms/{name}/act_in"] = _rms(inputs[0])
                if out.is_floating_point() and out.dim() > 0:
                    direct[f"rms/{name}/act"] = _rms(out)
            m.register_forward_hook(record)
    stats.capture = True
    idx = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    if direct is not None:
        for name, m in dense.items():
            if isinstance(getattr(m, "weight", None), torch.Tensor):
                direct[f"rms/{name}/weight"], direct[f"rms/{name}/grad"] = _rms(m.weight), _rms(m.weight.grad)
    return stats.collect()


def test_rms_statistics_are_those_of_the_unsharded_model():
    direct = {}
    reference = _stats(1, direct)
    # fp32 sums of squares against fp64 ones over a few thousand entries: 1e-5 relative is ~100x the
    # rounding; a shard counted twice or missed is off by 30% or more.
    assert reference.keys() == direct.keys()
    for key, value in reference.items():
        assert abs(value - direct[key]) <= 1e-5 * direct[key], (key, value, direct[key])
    # Every dense layer's weight and grad; activations in and out, sharded ones included.
    for key in ("blocks.0.attn.qkv/act", "blocks.0.attn.out/act_in", "blocks.0.mlp/act_in", "head/act_in",
                "head/grad", "tok_emb/act", "blocks.0.mlp.up/weight"):
        assert reference[f"rms/{key}"] > 0, key
    # With sequence parallelism the sequence-side activations are shares of the sequence.
    for rank, stats in enumerate(run_ranks(_stats, 2, 2) + run_ranks(_stats, 2, 2, None, True)):
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


def test_the_classifier_plot_adds_an_accuracy_panel_and_marks_resumes(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False)
    for record in ({"kind": "train", "step": 10, "loss": 5.0}, {"kind": "resume", "step": 10},
                   {"kind": "train", "step": 20, "loss": 4.0}, {"kind": "eval", "step": 20, "eval_loss": 4.2,
                                                                "top1": 0.2, "top5": 0.5}):
        log.write(record)
    log.close()

    def width(png):  # a PNG's width: bytes 16..20 of its header
        return int.from_bytes(png.read_bytes()[16:20], "big")

    one = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png", title="run-a: gpt")
    two = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "both.png", title="run-a: classifier",
                          loss_unit="nats/window", accuracy=True)
    assert width(two) == 2 * width(one)


def test_the_end_of_run_summary_names_what_the_run_directory_holds(tmp_path):
    from types import SimpleNamespace

    from bigdense.jobs.setup import Run

    step = tmp_path / "checkpoints" / "step_0000002"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"x" * 3_000_000)
    run = Run(SimpleNamespace(tp_size=2, dp_size=1), tmp_path)
    text = run.describe_outputs([tmp_path / "metrics.jsonl", None], tmp_path / "tensorboard")
    assert "metrics.jsonl" in text and "1 checkpoint(s), 3 MB" in text and "trainer.keep_last" in text
    assert f".venv/bin/tensorboard --logdir {tmp_path / 'tensorboard'}" in text


def test_a_sharded_batchnorm_between_the_pair_is_no_dense_layer_of_the_statistics():
    # Per-feature (maybe without a weight): only the two Linear layers around it report.
    block = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, affine=False), torch.nn.ReLU(),
                                torch.nn.Linear(8, 6))
    ctx = bd.init_parallel(tp=1)
    bd.parallelize(block)
    assert isinstance(block[1], bd.ShardedBatchNorm1d)
    stats = DenseLayerStats(block, ctx.tp_group)
    stats.capture = True
    block(torch.randn(4, 6)).sum().backward()
    assert {key.split("/")[1] for key in stats.collect()} == {"0", "3"}


def test_each_launch_records_its_layout_and_the_title_names_every_layout(tmp_path):
    from bigdense.train.metrics import layout_history

    log = MetricsLog(tmp_path, enabled=True)
    log.write_launch(0, {"tp": 2, "dp": 1})
    log.write({"kind": "train", "step": 40, "loss": 5.0})
    log.write_launch(40, {"tp": 1, "dp": 2})
    log.write({"kind": "train", "step": 80, "loss": 4.0})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r.get("layout")) for r in records if "layout" in r] == [
        ("start", 0, {"tp": 2, "dp": 1}), ("resume", 40, {"tp": 1, "dp": 2})]
    assert layout_history(records) == "tp=2 x dp=1 (steps 0-40), tp=1 x dp=2 (steps 40-80)"

    def launch(step, tp, dp=1):
        return {"kind": "start" if step == 0 else "resume", "step": step, "layout": {"tp": tp, "dp": dp}}

    train = [{"kind": "train", "step": s, "loss": 1.0} for s in (10, 20, 30)]
    assert layout_history([launch(0, 2), *train, launch(20, 2)]) == "tp=2 x dp=1"  # one layout, resumed
    assert layout_history([launch(0, 2), launch(0, 1)] + train) == "tp=1 x dp=1"  # relaunched before a step
    assert layout_history(train) == ""  # metrics written before launches recorded their layout
    assert layout_history([*train[:2], launch(20, 4)] + train[2:]) == \
        "layout not recorded (steps 0-20), tp=4 x dp=1 (steps 20-30)"


@pytest.mark.parametrize("accuracy", [False, True], ids=["loss", "loss-and-accuracy"])
def test_the_loss_curve_title_fits_the_figure_above_its_panels(accuracy):
    # A torchrun run directory's name is a 36-character id; the title adds the model and two layouts.
    from bigdense.train.metrics import loss_curve_figure

    records = [{"kind": "start", "step": 0, "layout": {"tp": 2, "dp": 1}},
               {"kind": "train", "step": 40, "loss": 5.0}, {"kind": "resume", "step": 40, "layout": {"tp": 1, "dp": 2}},
               {"kind": "train", "step": 80, "loss": 4.0}, {"kind": "eval", "step": 80, "eval_loss": 4.2, "top1": 0.2,
                                                             "top5": 0.5}]
    for name in ("torchrun-0b74a1b1-9c2d-4c1e-8f3a-7e5f1c2b3a4d", "run-" + "x" * 150):  # the second cannot fit unbroken
        fig = loss_curve_figure(records, title=f"{name}: gpt d=256 x 4 layers, fp32, ddp", accuracy=accuracy)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle
        box, figure = title.get_window_extent(renderer), fig.bbox
        inside = figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1
        assert inside, (box, figure)
        for ax in fig.axes:  # nothing of a panel under the title
            assert ax.get_tightbbox(renderer).y1 <= box.y0, (ax.get_tightbbox(renderer), box)
        text = title.get_text().replace("\n", " ")
        assert "tp=2 x dp=1 (steps 0-40)" in text and "tp=1 x dp=2 (steps 40-80)" in text
        assert title.get_fontsize() >= 8
        import matplotlib.pyplot as plt

        plt.close(fig)
