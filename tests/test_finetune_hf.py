"""The fine-tune job, `launch/train.py model=hf model.path=DIR`, against plain transformers.

Checkpoints are written by `save_pretrained` in the test's own directories
(`bigdense.testing.pretrained`: random weights, a byte-level BPE tokenizer with ``</s>``). The
reference is the same directory loaded by ``AutoModelForCausalLM.from_pretrained`` and trained by a
loop written here: the same batches (the job's data module, with the model's tokenizer), torch's
AdamW at a constant learning rate, ``clip_grad_norm_``. Nothing of bigdense's model, engine or
checkpoint code is in it.

Tolerances: fp32 throughout. Tensor parallelism splits the matmuls' sums over ranks (the row
layers' partial sums are added by an all-reduce) and data parallelism averages two half-batch
gradients instead of one mean, so each step differs from the reference by float rounding, which
Adam's first steps can amplify where a gradient element is near zero: losses agree to 1e-6
relative over four steps (measured: at most 8e-8, 2026-12-03). A resumed run is the same
computation as an uninterrupted one and must agree exactly.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import BIN, ROOT, TRAIN
from bigdense.config.schema import DataConfig
from bigdense.data import prepare_data
from bigdense.models.hf_dir import HFDirectory
from bigdense.testing.pretrained import write_pretrained

pytestmark = pytest.mark.slow  # each case launches launch/train.py in fresh processes

STEPS = 4
LR = 1e-3
SEED = 1234  # trainer.seed's default: the job's batches


def data_overrides(cache) -> list[str]:
    return ["data.max_corpus_mb=0.5", f"data.cache_dir={cache}", "data.seq_len=32", "data.micro_batch_size=2",
            "data.val_fraction=0.2"]


JOB = [f"trainer.max_steps={STEPS}", "optim=finetune", f"optim.lr={LR}", "optim.warmup_steps=1", "optim.schedule=constant", "trainer.log_interval=1",
       "trainer.eval_interval=0", "trainer.eval_batches=1", "trainer.progress_bar=false", "trainer.plot=false"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    # The Qwen3 one ties its head to the embedding, as Qwen3's small models do.
    return {kind: write_pretrained(root / kind, kind, tie_word_embeddings=kind == "qwen3")
            for kind in ("llama", "qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def launch(nproc: int, model_dir: Path, run_dir: Path, cache, *extra) -> str:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", TRAIN, "model=hf",
           f"model.path={model_dir}", f"trainer.run_dir={run_dir}", *data_overrides(cache), *JOB, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def reference_losses(model_dir: Path, cache, dp: int, steps: int = STEPS):
    """Plain transformers, trained on the job's global batches (every DP rank's rows, in order)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = DataConfig(max_corpus_mb=0.5, cache_dir=str(cache), seq_len=32, micro_batch_size=2, val_fraction=0.2)
    data = prepare_data(cfg, seed=SEED, tokenizer=HFDirectory.open(model_dir).tokenizer())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
    with torch.no_grad():  # the held-out loss before training, on the job's evaluation batch (every DP rank's rows)
        rows = [data.val_batches(1, rank, dp)[0] for rank in range(dp)]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        start = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten()).item()
    out = {0: start}
    for step in range(1, steps + 1):
        rows = [data.train_batch(step, 0, rank, dp) for rank in range(dp)]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out[step] = loss.item()
    return out, model, data


def assert_fine_tuned(run_dir: Path, want: dict, rtol: float = 1e-6):
    """The job's step losses are the reference's; its held-out loss fell below the starting model's."""
    got = losses(run_dir)
    assert sorted(got) == sorted(want)[1:], (got, want)
    for step in got:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got, want)
    held_out = records(run_dir, "eval")[-1]["eval_loss"]
    assert held_out < want[0], f"held-out loss {held_out} after {STEPS} steps, {want[0]} before"


@pytest.mark.parametrize("kind, nproc, tp", [("llama", 2, 2), ("llama", 4, 2), ("qwen3", 2, 2), ("qwen3", 4, 2)],
                         ids=["llama-tp2", "llama-tp2xdp2", "qwen3-tp2", "qwen3-tp2xdp2"])
def test_first_steps_equal_plain_transformers(tmp_path, checkpoints, cache, kind, nproc, tp):
    launch(nproc, checkpoints[kind], tmp_path / "run", cache, f"parallel.tp={tp}")
    want, _, _ = reference_losses(checkpoints[kind], cache, dp=nproc // tp)
    assert_fine_tuned(tmp_path / "run", want)


def test_moe_checkpoint_fine_tunes_like_plain_transformers(tmp_path, checkpoints, cache):
    launch(2, checkpoints["qwen3_moe"], tmp_path / "run", cache, "parallel.tp=2")
    want, _, _ = reference_losses(checkpoints["qwen3_moe"], cache, dp=1)
    assert_fine_tuned(tmp_path / "run", want)


def test_resume_is_exact_and_frozen_embeddings_stay(tmp_path, checkpoints, cache):
    frozen = ["model.freeze_embeddings=true", "trainer.save_interval=2"]
    launch(2, checkpoints["llama"], tmp_path / "whole", cache, *frozen)
    launch(2, checkpoints["llama"], tmp_path / "split", cache, *frozen, "trainer.max_steps=2")
    out = launch(2, checkpoints["llama"], tmp_path / "split", cache, *frozen, f"trainer.max_steps={STEPS}")
    assert "resum" in out.lower()
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # bit-exact, every step
    from safetensors import safe_open

    from bigdense.checkpoint import export_dense

    trained = export_dense(tmp_path / "whole", tmp_path / "trained.safetensors")
    with safe_open(trained, "pt") as f, safe_open(checkpoints["llama"] / "model.safetensors", "pt") as g:
        name = "model.embed_tokens.weight"
        assert torch.equal(f.get_tensor(f"lm.{name}"), g.get_tensor(name))  # frozen: as loaded
        layer = "model.layers.0.mlp.down_proj.weight"
        assert not torch.equal(f.get_tensor(f"lm.{layer}"), g.get_tensor(layer))  # trained
