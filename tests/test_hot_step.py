"""The training step a GPU would run: no host sync with checks off (fp32, bf16, fp16 at tp=2, and
at dp=2 under DDP and FSDP), clipping's bad arguments, MFU arithmetic and TensorBoard event files that TensorBoard reads."""
import json
import math
import os

import pytest
import torch
import torch.nn as nn

import bigdense as bd
from bigdense.testing.counters import OpCounter
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.models.gpt import GPT, GPTConfig
from bigdense.testing import run_ranks
from bigdense.train.engines import EngineSettings, build_engine
from bigdense.train.flops import PEAK_BF16_TFLOPS, flops_per_token, mfu, peak_tflops

VOCAB, SEQ, B = 61, 8, 4


def _step_syncs(tp, dtype, engine_kind="ddp"):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=SEQ, dropout=0.1,
                    attention_dropout=0.1, head_chunk_size=8)
    model = GPT(cfg, tp_group=ctx.tp_group)
    rows = B // ctx.dp_size
    settings = EngineSettings(engine=EngineConfig(kind=engine_kind), optim=OptimConfig(warmup_steps=2, grad_clip=1.0),
                              precision=PrecisionConfig(dtype=dtype), micro_batch_size=rows, max_steps=10)
    engine = build_engine(model, ctx, settings)
    idx = torch.randint(0, VOCAB, (B, SEQ), generator=torch.Generator().manual_seed(1))
    mine = idx[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows]
    batch = [(mine, mine.roll(-1, dims=1))]
    out = {}
    for checks in (True, False):
        with bd.set_checks(checks), OpCounter() as counter:
            result = engine.train_step(batch)
        out[checks] = dict(counter.sync_ops)
    assert math.isfinite(float(result.loss)) and not bool(result.skipped)
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tp,engine_kind", [(2, "ddp"), (1, "ddp"), (1, "fsdp")])  # tp=1 on 2 processes: dp=2
def test_a_training_step_makes_no_host_sync_with_checks_off(tp, engine_kind, dtype):
    for rank in run_ranks(_step_syncs, 2, tp, dtype, engine_kind):
        assert rank[False] == {}, rank[False]  # forward, backward, unscale, clip, vote, AdamW, LR, scaler
        assert rank[True], "the counter must see the host-side id/label checks"


def _clip_errors(bad, match):
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=match):
        bd.clip_grad_norm_([p], *bad)


@pytest.mark.parametrize("bad,match", [
    ((0.0,), "max_norm must be a finite number > 0, got 0.0"),
    ((-1.0,), "max_norm must be a finite number > 0, got -1.0"),
    ((math.nan,), "max_norm must be a finite number > 0, got nan"),
    ((math.inf,), "max_norm must be a finite number > 0, got inf"),
    ((1.0, "fro"), "norm_type must be a number > 0 or inf, got 'fro'"),
    ((1.0, -2.0), "norm_type must be a number > 0 or inf, got -2.0"),
])
def test_clip_rejects_bad_max_norm_and_norm_type(bad, match):
    _clip_errors(bad, match)


def test_grad_norm_measures_without_clipping():
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    assert float(bd.grad_norm([p])) == 6.0 and torch.equal(p.grad, torch.full((4,), 3.0))
    assert float(bd.grad_norm([p], math.inf)) == 3.0


def test_mfu_is_six_n_plus_attention_over_the_peak():
    # 6 N + 12 L d S: the standard count (PaLM appendix B), forward and backward.
    assert flops_per_token(124_000_000, 12, 768, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert mfu(1000.0, 1e9, 1.0) == pytest.approx(1.0)  # 1000 tok/s x 1 GFLOP = 1 TFLOP/s of a 1 TFLOP/s peak
    assert mfu(1000.0, 1e9, None) is None
    assert peak_tflops("cpu") is None and peak_tflops("cpu", 312.0) == 312.0
    assert PEAK_BF16_TFLOPS["H100"] == 989.0 and PEAK_BF16_TFLOPS["A100"] == 312.0


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bigdense.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True, tensorboard=True)
    for step, loss in ((10, 4.5), (20, 3.25)):
        log.write({"kind": "train", "step": step, "loss": loss, "mfu": None, "skipped": False, "lr": 1e-3})
    log.write({"kind": "eval", "step": 20, "eval_loss": 3.5})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 4.5), (20, 3.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/eval_loss")] == [(20, 3.5)]
    assert "train/mfu" not in events.Tags()["scalars"]  # None (no peak known) is not a number


# What the GPU machine lacks: the benchmark and everything it imports must work without them.
_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "deepspeed", "xxhash"):
            raise ImportError("not on this machine: " + name)
sys.meta_path.insert(0, Block())
from bigdense.bench import gpu
sys.exit(gpu.main(sys.argv[1:]))
"""


def test_bench_gpu_needs_no_hydra_omegaconf_deepspeed_or_xxhash(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine this would run the whole benchmark")
    out = subprocess.run([sys.executable, "-c", _BLOCK, "--json", str(tmp_path / "g.jsonl")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    from bigdense.bench.gpu import CASE_ORDER
    from bigdense.bench.gpu_finetune import CONTENDERS

    rows = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    # Every case writes its row (the smoke run's contents: tests/test_bench_gpu.py).
    gpt = [(r["case"], r["mode"]) for r in rows if r["case"] != "finetune"]
    assert sorted(gpt) == sorted(CASE_ORDER), rows
    assert sorted((r["contender"], r["mode"]) for r in rows if r["case"] == "finetune") == sorted(CONTENDERS), rows


def _embedding_bad_id(tp):
    bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    emb = bd.VocabParallelEmbedding(10, 4)
    ids = torch.tensor([[1, 12, 3]])
    with pytest.raises(ValueError, match="id 12 is outside"):
        emb(ids)
    with bd.set_checks(False):
        out = emb(ids)
    return torch.isnan(out[0, 1]).all().item(), torch.isfinite(out[0, [0, 2]]).all().item()


def test_an_out_of_range_id_with_checks_off_gives_a_nan_row_at_tp2():
    # No rank owns the id, so no rank writes its row: marked NaN on the device instead of zeros.
    for nan_row, others_finite in run_ranks(_embedding_bad_id, 2, 2):
        assert nan_row and others_finite
