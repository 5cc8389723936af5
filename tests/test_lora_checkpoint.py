"""Checkpoints of models with low-rank adapters (`bigdense.checkpoint.lora_state`) and their export.

What is compared, and why each tolerance:

* A tiny Llama (hidden 36, 6 heads over 3 key/value heads, MLP 44, so tp=3 splits it unevenly),
  converted at tp=2, given adapters and trained 2 AdamW steps, is saved; loaded at tp=1 and tp=3,
  every adapter factor and every optimizer state tensor must be this rank's slice of the full
  tensor the checkpoint holds, bit for bit (a load copies stored bytes; nothing is summed), and the
  frozen base must be untouched. The checkpoint's tensors are the factors and their AdamW state
  only: their bytes are counted against the factors' sizes.
* The refusals are checked by the exception's type and the words that tell the user what to do.
* Export: the PEFT adapter directory, loaded by ``peft.PeftModel.from_pretrained`` on the plain
  transformers model, and the merged directory, loaded by ``AutoModelForCausalLM.from_pretrained``,
  must give the logits bigdense's model gave at tp=2, to 1e-5: fp32, and the only differences are
  the order of sums (the TP all-reduces of the row layers and of the adapters' (tokens, r) partial
  products; the merged weight ``W + s B A`` applied as one matmul instead of ``W x + s B (A x)``),
  ~1e-7 relative per op over a 2-layer model.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import bigdense as bd
from bigdense.checkpoint import CheckpointMismatch, export_hf
from bigdense.checkpoint.boxes import narrow_box
from bigdense.checkpoint.format import SafetensorsReader, dtype_from_code, read_manifest, resolve_checkpoint
from bigdense.checkpoint.lora_state import LoRABase, hf_base
from bigdense.layers.base import named_shard_specs
from bigdense.layers.lora import is_lora_name
from bigdense.models import CausalLM
from bigdense.testing import run_ranks
from helpers import BIN, ROOT, TRAIN, uneven_llama

transformers = pytest.importorskip("transformers")

R, ALPHA, LR = 4, 8, 1e-2
BASE = LoRABase("/models/tiny-llama", "xxh3_128:0123456789abcdef")
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5))


def batches(steps=2):
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 61, (2, 13), generator=g) for _ in range(steps)]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]


def start():
    """Every rank of `run_ranks` in one TP group."""
    bd.init_parallel(tp=torch.distributed.get_world_size())


def adapted(lm=None, lora=True, **settings):
    """The model on the context's TP size, with adapters (``settings`` change add_lora's)."""
    lm = uneven_llama() if lm is None else lm
    model = CausalLM(bd.parallelize(lm) if bd.get_default_context().tp_size > 1 else lm)
    if lora:
        bd.add_lora(model, **{"r": R, "alpha": ALPHA, **settings})
    model.prepare_loss()
    return model


def optimizer_of(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def train(model, optimizer, steps=2):
    for x, y in batches(steps):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def saved_full(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole: ``{manifest key: tensor}`` (assembled here from the boxes)."""
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    out = {}
    for key, entry in manifest["tensors"].items():
        full = torch.empty(entry["global_shape"], dtype=dtype_from_code(entry["dtype"]))
        for shard in entry["shards"]:
            with SafetensorsReader(ckpt / shard["file"]) as reader:
                narrow_box(full, [0] * full.dim(), shard["offsets"], shard["shape"]).copy_(reader.view(shard["name"]))
        out[key] = full
    return out


# ---- (a) adapters and their optimizer state at any layout ----
def _train_and_save(path):
    start()
    model = adapted()
    optimizer = optimizer_of(model)
    train(model, optimizer)
    bd.save_checkpoint(path, model, optimizer, step=2, base=BASE)


def _load_and_compare(path):
    """This rank's adapters and AdamW state against the checkpoint's full tensors; the base untouched."""
    start()
    model = adapted()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = optimizer_of(model)
    info = bd.load_checkpoint(path, model, optimizer, base=BASE)
    full, specs = saved_full(path), named_shard_specs(model)
    differ, compared = [], 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            differ += [name] if not torch.equal(p, base[name]) else []
            continue
        spec = specs.get(name)
        part = (lambda t: t) if spec is None else spec.slice_of
        compared += 1
        differ += [name] if not torch.equal(p.detach(), part(full[f"model/{name}"])) else []
        for key, value in optimizer.state[p].items():
            stored = full[f"optim/{name}/{key}"]
            compared += 1
            differ += [f"{name}/{key}"] if not torch.equal(value, part(stored) if value.dim() else stored) else []
    train(model, optimizer, steps=1)  # the loaded state steps on
    return differ, compared, info.step, info.lora["r"]


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory):
    """A LoRA checkpoint written at tp=2 after 2 AdamW steps."""
    path = tmp_path_factory.mktemp("lora") / "step_2"
    run_ranks(_train_and_save, 2, str(path), timeout=240)
    return path


@pytest.mark.parametrize("tp", [1, 3])
def test_adapters_and_optimizer_state_load_at_any_tp_bit_identical(lora_ckpt, tp):
    for differ, compared, step, r in run_ranks(_load_and_compare, tp, str(lora_ckpt), timeout=240):
        assert differ == [] and step == 2 and r == R
        assert compared == 14 * 2 * 4  # 14 adapted projections x 2 factors x (weight, exp_avg, exp_avg_sq, step)


def test_lora_checkpoint_holds_no_base_tensor(lora_ckpt):
    manifest = read_manifest(lora_ckpt)
    model = adapted()  # tp=1 here: the global shapes
    factors = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(is_lora_name(n) for n in factors) and len(factors) == 28
    models = {k[len("model/"):]: e for k, e in manifest["tensors"].items() if k.startswith("model/")}
    assert set(models) == set(factors)
    factor_bytes = sum(p.numel() * 4 for p in factors.values())
    # What the shard files hold: the factors, and AdamW's two moments of each plus its step counter; the
    # rest of the files' bytes are their headers.
    files = sorted(lora_ckpt.glob("*.safetensors"))
    held = sum(r.nbytes(n) for p in files for r in [SafetensorsReader(p)] for n in r.header)
    assert held == 3 * factor_bytes + 28 * 4  # fp32 step counters
    headers = sum(p.stat().st_size for p in files) - held
    assert headers < 1500 * len(files) * 28 // len(files)  # ~ 200 bytes of JSON per stored tensor
    record = manifest["lora"]
    assert (record["r"], record["alpha"], record["dropout"], record["rslora"]) == (R, ALPHA, 0.0, False)
    assert record["base"] == {"path": BASE.path, "digest": BASE.digest} and record["overrides"] == {}
    assert sorted(record["layers"]) == sorted({n.rsplit(".", 2)[0] for n in factors})


# ---- (b) refusals ----
def _refusals(lora_path, full_path):
    start()
    out = {}

    def attempt(what, fn):
        try:
            fn()
            out[what] = None
        except Exception as err:  # noqa: BLE001
            out[what] = (type(err).__name__, str(err))

    plain = adapted(lora=False)
    before = {n: p.detach().clone() for n, p in plain.state_dict().items()}
    attempt("into_plain", lambda: bd.load_checkpoint(lora_path, plain))
    out["plain_untouched"] = all(torch.equal(p, before[n]) for n, p in plain.state_dict().items())
    attempt("other_r", lambda: bd.load_checkpoint(lora_path, adapted(r=8)))
    attempt("other_alpha", lambda: bd.load_checkpoint(lora_path, adapted(alpha=4)))
    attempt("other_targets", lambda: bd.load_checkpoint(lora_path, adapted(targets=["q_proj", "v_proj"])))
    attempt("other_base", lambda: bd.load_checkpoint(lora_path, adapted(), base=LoRABase("/else", "xxh3_128:ff")))
    attempt("same_base_as_dict", lambda: bd.load_checkpoint(lora_path, adapted(), base={"path": "/moved",
                                                                                        "digest": BASE.digest}))
    attempt("other_dropout", lambda: bd.load_checkpoint(lora_path, adapted(dropout=0.1)))
    model = adapted()
    attempt("full_into_adapted", lambda: bd.load_checkpoint(full_path, model, optimizer_of(model)))
    attempt("full_strict", lambda: bd.load_checkpoint(full_path, model))
    info = bd.load_checkpoint(full_path, model, strict=False)  # its weights into the frozen base
    saved = saved_full(full_path)
    out["full_loose"] = (len(info.missing), all(torch.equal(p, saved[f"model/{n}"]) for n, p in
                                                model.state_dict().items() if not is_lora_name(n)))
    attempt("base_without_adapters", lambda: bd.save_checkpoint(Path(full_path).parent / "x", plain, base=BASE))
    # trainer.init_from of a full checkpoint into a LoRA run: loaded before add_lora, a plain load
    fresh = adapted(lora=False)
    bd.load_checkpoint(full_path, fresh, load_rng=False)
    bd.add_lora(fresh, r=R, alpha=ALPHA)
    out["init_from_then_adapters"] = all(torch.equal(p, saved[f"model/{n}"]) for n, p in fresh.state_dict().items()
                                         if not is_lora_name(n))
    return out


def test_refusals(lora_ckpt, tmp_path):
    def _save_full(path):
        start()
        model = adapted(uneven_llama(seed=1), lora=False)
        bd.save_checkpoint(path, model, optimizer_of(model), step=1)

    full = tmp_path / "full" / "step_1"
    run_ranks(_save_full, 1, str(full))
    (out,) = run_ranks(_refusals, 1, str(lora_ckpt), str(full), timeout=240)
    kind, text = out["into_plain"]
    assert kind == "CheckpointMismatch" and "LoRA checkpoint" in text and "add adapters with the same settings" in text
    assert "--merge" in text and BASE.digest in text and "r=4" in text and out["plain_untouched"]
    kind, text = out["other_r"]
    assert kind == "CheckpointMismatch" and "r=4 in the checkpoint, 8 in the model" in text
    kind, text = out["other_alpha"]
    assert kind == "CheckpointMismatch" and "alpha=8.0 in the checkpoint, 4.0 in the model" in text
    kind, text = out["other_targets"]
    assert kind == "CheckpointMismatch" and "adapted layers differ" in text and "only in the checkpoint" in text
    kind, text = out["other_base"]
    assert kind == "CheckpointMismatch" and BASE.digest in text and "xxh3_128:ff" in text and "/else" in text
    assert out["same_base_as_dict"] is None and out["other_dropout"] is None  # a moved base; dropout trains only
    kind, text = out["full_into_adapted"]
    assert kind == "CheckpointMismatch" and "full checkpoint" in text and "before add_lora" in text
    assert "optimizer state" in text
    kind, text = out["full_strict"]
    assert kind == "CheckpointMismatch" and "strict=False" in text
    assert out["full_loose"] == (28, True)
    kind, text = out["base_without_adapters"]
    assert kind == "ValueError" and "has none" in text
    assert out["init_from_then_adapters"]


# ---- (c) export: a PEFT adapter directory, and the merged model ----
def _train_hf(src, run):
    """At tp=2: the base loaded from ``src``, adapters trained 2 steps, saved as a run's checkpoint;
    the logits of ``IDS`` after training."""
    from transformers import AutoModelForCausalLM

    start()
    model = adapted(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), alpha=ALPHA, rslora=True)
    optimizer = optimizer_of(model)
    train(model, optimizer)
    bd.save_checkpoint(f"{run}/checkpoints/step_2", model, optimizer, step=2, base=hf_base(src),
                       config={"model": {"name": "hf", "path": str(src)}})
    with torch.no_grad():
        return model.eval().logits(IDS)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    from bigdense.testing.pretrained import write_pretrained

    root = tmp_path_factory.mktemp("hf_lora")
    src = write_pretrained(root / "base", "llama", vocab_size=64, hidden_size=36, intermediate_size=44,
                           num_attention_heads=6, num_key_value_heads=3, head_dim=6)
    logits = run_ranks(_train_hf, 2, str(src), str(root / "run"), timeout=300)[0]
    return src, root / "run", logits


def test_export_peft_adapter_loads_in_peft(hf_run, tmp_path):
    peft = pytest.importorskip("peft")
    from bigdense.export_hf import main

    src, run, want = hf_run
    assert main([str(run), str(tmp_path / "adapter")]) == 0
    out = tmp_path / "adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(src.resolve())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (R, ALPHA, True)
    assert (out / "tokenizer.json").is_file() and not (out / "config.json").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_merged_loads_in_transformers(hf_run, tmp_path):
    from bigdense.export_hf import main

    src, run, want = hf_run
    assert main([str(run), str(tmp_path / "merged"), "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # the adapters changed the model: the comparison above says something
        assert (base(input_ids=IDS).logits - want).abs().max() > 1e-3
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_merge_refuses_a_changed_base(hf_run, tmp_path):
    src, run, _ = hf_run
    ckpt = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(run / "checkpoints" / "step_2", ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["lora"]["base"]["digest"] = "xxh3_128:00"
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointMismatch, match="xxh3_128:00") as err:
        export_hf(ckpt, tmp_path / "merged", merge=True)
    assert str(src.resolve()) in str(err.value) and not (tmp_path / "merged").exists()


# ---- the job: a LoRA run resumes exactly, and checks its base ----
def _job(nproc, base, run_dir, cache, *extra, ok=True) -> str:
    """``launch/train.py`` of a LoRA fine-tune (r=4, saving every 2 steps); its output."""
    runner = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [str(BIN / "python")]
    cmd = [*runner, TRAIN, "model=hf",
           f"model.path={base}", f"trainer.run_dir={run_dir}", "data.max_corpus_mb=0.5", f"data.cache_dir={cache}",
           "data.seq_len=32", "data.micro_batch_size=2", "data.val_fraction=0.2", "optim=finetune", "optim.lr=1e-3",
           "optim.warmup_steps=1", "optim.schedule=constant", "trainer.log_interval=1", "trainer.eval_interval=0",
           "trainer.eval_batches=1", "trainer.progress_bar=false", "trainer.plot=false", "lora=adapters", "lora.r=4",
           "trainer.save_interval=2", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert (out.returncode == 0) == ok, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def _losses(run_dir: Path) -> dict:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.slow  # four launches of launch/train.py
def test_job_resumes_a_lora_run_exactly_and_checks_its_base(tmp_path):
    from bigdense.testing.pretrained import write_pretrained

    base, cache = write_pretrained(tmp_path / "base", "llama"), tmp_path / "cache"
    _job(2, base, tmp_path / "whole", cache, "parallel.tp=2", "trainer.max_steps=4")
    _job(2, base, tmp_path / "split", cache, "parallel.tp=2", "trainer.max_steps=2")
    shutil.copytree(tmp_path / "split" / "checkpoints", tmp_path / "other" / "checkpoints")
    assert "resumed" in _job(2, base, tmp_path / "split", cache, "parallel.tp=2", "trainer.max_steps=4")
    assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")  # the resumed run is the same computation
    # The tp=2 checkpoint resumed by one process (tp=1): the same steps up to the other summation order.
    _job(1, base, tmp_path / "other", cache, "trainer.max_steps=4")
    whole, other = _losses(tmp_path / "whole"), _losses(tmp_path / "other")
    assert sorted(other) == [3, 4] and other == pytest.approx({s: whole[s] for s in other}, rel=1e-5, abs=0)
    manifest = read_manifest(resolve_checkpoint(tmp_path / "split"))
    assert manifest["lora"]["base"] == {"path": str(base.resolve()), "digest": hf_base(base).digest}
    assert all(is_lora_name(k.split("/", 1)[1]) for k in manifest["tensors"] if k.startswith("model/"))
    # The base's weights changed under the same path: the run refuses to resume on them.
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] + 1e-3
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    out = _job(1, base, tmp_path / "split", cache, "trainer.max_steps=6", ok=False)
    assert "cannot resume" in out and manifest["lora"]["base"]["digest"] in out and "another base" in out
