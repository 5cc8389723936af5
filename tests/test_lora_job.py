"""The fine-tune job with low-rank adapters, `launch/train.py model=hf model.adapter=DIR`, against PEFT.

A PEFT adapter (written by ``peft`` on the plain transformers model, ``lora_B`` non-zero so it acts
from the first step) starts the job at tp=2; the reference is the same directory and adapter in
``peft.PeftModel`` trained by a loop written here on the job's batches (torch's AdamW, clipping at
1). Then what the run writes is read back by PEFT and transformers themselves: ``export_hf``'s
adapter directory in ``PeftModel.from_pretrained``, ``export_hf --merge`` in
``AutoModelForCausalLM.from_pretrained``. (A LoRA run's resume: tests/test_lora_checkpoint.py.)

Tolerances: fp32. TP splits the matmuls' sums (and the adapters' (tokens, r) partial products) over
ranks, ~1e-7 relative per op, which AdamW's first steps can amplify where a gradient element is
near zero: 1e-5 relative on losses and logits, and on each adapter factor 1e-5 of its largest
element (an element near zero that Adam moved by a last-bit-different gradient is off by ~2e-7
after 4 steps at lr 1e-3, 2e-5 of itself: measured).
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
peft = pytest.importorskip("peft")

STEPS, LR, SEED, TOL = 4, 1e-3, 1234, 1e-5
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA = dict(max_corpus_mb=0.5, seq_len=32, micro_batch_size=2, val_fraction=0.2)
JOB = [f"trainer.max_steps={STEPS}", "optim=finetune", f"optim.lr={LR}", "optim.warmup_steps=1",
       "optim.schedule=constant", "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.eval_batches=1",
       "trainer.progress_bar=false", "trainer.plot=false", "trainer.save_interval=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama directory and a PEFT adapter on its seven projections."""
    root = tmp_path_factory.mktemp("lora_job")
    model_dir = write_pretrained(root / "llama", "llama")
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS))
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(root / "adapter")
    return model_dir, root / "adapter", root / "cache"


def launch(nproc: int, base, run_dir: Path, *extra) -> str:
    model_dir, adapter, cache = base
    data = [f"data.{k}={v}" for k, v in DATA.items()] + [f"data.cache_dir={cache}"]
    runner = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [str(BIN / "python")]
    cmd = [*runner, TRAIN, "model=hf", f"model.path={model_dir}", f"model.adapter={adapter}",
           f"trainer.run_dir={run_dir}", *data, *JOB, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def peft_reference(base):
    """PEFT's LoRA on plain transformers, trained on the job's global batches: losses, the model."""
    from transformers import AutoModelForCausalLM

    model_dir, adapter, cache = base
    data = prepare_data(DataConfig(cache_dir=str(cache), **DATA), seed=SEED,
                        tokenizer=HFDirectory.open(model_dir).tokenizer())
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           adapter, is_trainable=True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = {}
    for step in range(1, STEPS + 1):
        x, y = data.train_batch(step, 0, 0, 1)
        loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out[step] = loss.item()
    return out, model.eval(), data


def test_adapter_job_equals_peft_and_exports_for_peft(tmp_path, base):
    out = launch(2, base, tmp_path / "run", "parallel.tp=2")
    assert "trainable" in out and "from " + str(base[1]) in out
    assert "gathered logits" not in out  # the fused head, proved with the head frozen
    want, reference, data = peft_reference(base)
    got = losses(tmp_path / "run")
    assert got == pytest.approx(want, rel=TOL, abs=0)

    from transformers import AutoModelForCausalLM

    subprocess.run([str(BIN / "python"), "-m", "bigdense.export_hf", str(tmp_path / "run"), str(tmp_path / "adapter")],
                   cwd=ROOT, check=True, capture_output=True)
    subprocess.run([str(BIN / "python"), "-m", "bigdense.export_hf", str(tmp_path / "run"), str(tmp_path / "merged"),
                    "--merge"], cwd=ROOT, check=True, capture_output=True)
    x, _ = data.val_batches(1, 0, 1)[0]
    with torch.no_grad():
        want_logits = reference(input_ids=x).logits
        exported = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base[0], dtype=torch.float32), tmp_path / "adapter").eval()
        torch.testing.assert_close(exported(input_ids=x).logits, want_logits, rtol=TOL, atol=TOL)
        trained = {n: p for n, p in reference.named_parameters() if "lora_" in n}
        for name, p in exported.named_parameters():
            if "lora_" in name:
                scale = trained[name].abs().max().item()  # 1e-5 of the factor's largest element (see above)
                torch.testing.assert_close(p, trained[name], rtol=TOL, atol=TOL * scale, msg=lambda m: f"{name}: {m}")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(input_ids=x).logits, want_logits, rtol=TOL, atol=TOL)
