"""`bd.export_hf` and ``python -m bigdense.export_hf``: tiny Hugging Face causal LMs (Llama, tied
Llama, Qwen3, and the MoE Mixtral and Qwen3-MoE, whose fused experts transformers splits back per
expert on saving), converted at tp=2 and saved as `CausalLM` checkpoints, come back as directories
``from_pretrained`` loads with no missing or unexpected keys, holding exactly the tensors the
original model's own ``save_pretrained`` writes.

Tolerance: none. The export copies the stored fp32 bits (the shards are boxes of the global tensor,
nothing is summed), so the loaded model is the original bit for bit, and the same eager forward in
the same process gives identical logits; the bf16 export loads as the original's own directory
loaded in bf16, bit for bit.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import bigdense as bd
from bigdense.checkpoint import CheckpointError
from bigdense.models import CausalLM
from bigdense.testing import run_ranks

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
CASES = {"llama": ("llama", {}), "llama_tied": ("llama", {"tie_word_embeddings": True}), "qwen3": ("qwen3", {}),
         "mixtral": ("mixtral", {}), "qwen3_moe": ("qwen3_moe", {})}
WORDS = {"[UNK]": 0, "hello": 1, "world": 2}
IDS = torch.randint(3, 250, (2, 8), generator=torch.Generator().manual_seed(3))


def _reference(case):
    from bigdense.testing.hf_models import build_tiny

    model_type, overrides = CASES[case]
    torch.manual_seed(0)
    return build_tiny(model_type, **overrides)


def _save_checkpoints(root):
    """Each case converted at tp=2, saved in a run directory; and a checkpoint of no CausalLM."""
    ctx = bd.init_parallel(tp=2)
    for case in CASES:
        lm = _reference(case)
        bd.parallelize(lm, tp_group=ctx.tp_group)
        bd.save_checkpoint(f"{root}/{case}/run/checkpoints/step-1", model=CausalLM(lm), step=1,
                           config={"model": {"name": "hf", "path": f"{root}/{case}/src"}})
    bd.save_checkpoint(f"{root}/plain/step-1", model=nn.Linear(4, 3), step=1)


def _write_tokenizer(directory: Path):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{case: (run directory, reference model)}``, and ``"root"``: their parent. ``src`` is the original's ``save_pretrained``
    (weights included: what model.path names); ``run/hf`` what the training job copies of it."""
    root = tmp_path_factory.mktemp("export_hf")
    references = {}
    for case in CASES:
        references[case] = _reference(case).eval()
        src = root / case / "src"
        references[case].save_pretrained(src)
        transformers.GenerationConfig(max_new_tokens=7).save_pretrained(src)
        _write_tokenizer(src)
        (root / case / "run" / "hf").mkdir(parents=True)
        for path in src.iterdir():
            if not path.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copyfile(path, root / case / "run" / "hf" / path.name)
    run_ranks(_save_checkpoints, 2, str(root), timeout=120)
    return {case: (root / case / "run", references[case]) for case in CASES} | {"root": root}


def _load(out, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True, **kwargs)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return model.eval()


def _tensors(directory: Path) -> dict:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_as_the_original(runs, case, tmp_path):
    run, reference = runs[case]
    out = bd.export_hf(run, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    # The names and bits transformers' own save_pretrained writes: experts per expert, a tied head once.
    written, original = _tensors(out), _tensors(run.parent / "src")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert torch.equal(_logits(_load(out)), _logits(reference))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world")["input_ids"] == [WORDS["hello"], WORDS["world"]]


def test_small_shards_write_an_index_and_load(runs, tmp_path):
    run, reference = runs["mixtral"]
    limit = 20_000  # smaller than a layer's attention, larger than its norms: a mix of lone and shared files
    (tmp_path / "out").mkdir()  # an empty directory is taken as a new one
    out = bd.export_hf(run, tmp_path / "out", max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3 and not (out / "model.safetensors").exists()
    assert [f.name for f in files] == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                       for i in range(1, len(files) + 1)]
    for f in files:
        held = load_file(f)
        assert set(held) == {k for k, v in index["weight_map"].items() if v == f.name}
        assert len(held) == 1 or sum(t.nbytes for t in held.values()) <= limit, f.name
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _tensors(out).values())
    assert torch.equal(_logits(_load(out)), _logits(reference))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bigdense.export_hf", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_command_line_writes_bf16(runs, tmp_path):
    run, _ = runs["qwen3_moe"]
    done = _cli(run, tmp_path / "out", "--dtype", "bf16", "--max-shard-size", "100KB")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'out'}: 45 tensors") and "(bfloat16)" in done.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    model = _load(tmp_path / "out", dtype=torch.bfloat16)
    twin = _load(run.parent / "src", dtype=torch.bfloat16)  # the original's save_pretrained, loaded alike
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
    assert torch.equal(_logits(model), _logits(twin))


def test_bad_input_exits_2_with_one_line(runs, tmp_path):
    not_a_checkpoint = _cli(runs["root"], tmp_path / "a")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    taken = _cli(runs["llama"][0], tmp_path / "taken")
    for done, says in ((not_a_checkpoint, "is not a bigdense checkpoint"), (taken, "is not an empty directory")):
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.startswith("bigdense: ") and says in done.stderr and done.stderr.count("\n") == 1
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_config_found_at_model_path_else_a_clear_error(runs, tmp_path):
    run, reference = runs["llama"]
    lone = tmp_path / "step-1"  # a checkpoint outside any run: its config's model.path (weights and all)
    shutil.copytree(run / "checkpoints" / "step-1", lone)
    out = bd.export_hf(lone, tmp_path / "out", max_shard_size="50KB")
    assert not (out / "model.safetensors").exists()  # the source's weights are not copied over the export
    assert torch.equal(_logits(_load(out)), _logits(reference))

    manifest = json.loads((lone / "manifest.json").read_text())
    manifest["config"]["model"]["path"] = str(tmp_path / "gone")
    (lone / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"no config\.json .* in no run's hf/ .* and in .*gone"):
        bd.export_hf(lone, tmp_path / "out2")


def test_refuses_other_models_and_leaves_nothing_when_it_fails(runs, tmp_path):
    with pytest.raises(CheckpointError, match=r"not a checkpoint of a bigdense\.models\.CausalLM .*'weight'"):
        bd.export_hf(runs["root"] / "plain" / "step-1", tmp_path / "plain")
    run = tmp_path / "run"  # a copy whose last shard file is corrupted: found while writing
    shutil.copytree(runs["llama"][0], run)
    shard = run / "checkpoints" / "step-1" / "model-tp01-of-02.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        bd.export_hf(run, tmp_path / "out", max_shard_size="20KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
