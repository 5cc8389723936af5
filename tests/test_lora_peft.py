"""`bd.save_peft_adapter` / `bd.load_peft_adapter` against PEFT itself, on a tiny Llama whose sizes
split unevenly (hidden 36, 6 heads of 6, 3 kv heads, intermediate 44: tp=2 splits the kv heads 2/1,
tp=3 the MLP 15/15/14).

What is compared:

* an adapter ``peft`` writes (``get_peft_model(...).save_pretrained``, lora_B drawn non-zero) loaded
  into the model converted at tp=2 and tp=3 gives PEFT's logits: within 1e-5 (absolute, logits of
  size ~1), because the sharded forward sums the same products in another order (partial sums
  all-reduced over TP) -- float32 rounding of a few ulps, nothing more;
* that model saved again at tp=2 is a directory ``PeftModel.from_pretrained`` loads with no missing
  or unexpected keys, holding bit for bit the tensors PEFT wrote (the factors are gathered, not
  summed: tolerance none), and giving PEFT's logits (1e-5, the same forward in the same process:
  in fact equal);
* ``merge_lora_`` at tp=2, each weight gathered, equals PEFT's ``merge_and_unload()``: within 1e-6,
  since both add ``scaling * B @ A`` in float32 to the same weight, one computing the rows (column
  layers) or columns (row layers) of this rank's slice only -- the same r-term dot products, at
  most an ulp apart;
* a GPT-2 adapter (``Conv1D``, ``fan_in_fan_out``) the same way at tp=2;
* bad inputs are refused, naming the file, option or key.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import bigdense as bd
from bigdense.checkpoint import CheckpointError
from bigdense.checkpoint.peft import read_peft_adapter
from bigdense.layers.base import TensorParallelModule
from bigdense.layers.lora import LoRASettings, add_lora, merge_lora_
from bigdense.models import CausalLM
from bigdense.testing import run_ranks
from helpers import uneven_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
R, ALPHA = 4, 8


def peft_model(targets=TARGETS, **options):
    """PEFT's model of the tiny Llama, lora_B drawn non-zero (so the adapters change the logits)."""
    pm = peft.get_peft_model(uneven_llama(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets,
                                                           lora_dropout=0.0, **options))
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return pm.eval()


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    """A PEFT adapter directory written by ``peft`` itself, and PEFT's logits of that model."""
    directory = tmp_path_factory.mktemp("peft") / "adapter"
    pm = peft_model()
    pm.save_pretrained(str(directory))
    with torch.no_grad():
        logits = pm(input_ids=IDS).logits
    return directory, logits


def _load_at_tp(tp, adapter, out):
    """Rank body: the tiny Llama converted at ``tp``, the adapter loaded; its logits; saved to ``out``."""
    ctx = bd.init_parallel(tp=tp)
    model = CausalLM(bd.parallelize(uneven_llama(), tp_group=ctx.tp_group))
    settings = bd.load_peft_adapter(model, adapter)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        logits = model.lm(input_ids=IDS).logits
    if out is not None:
        bd.save_peft_adapter(model, out)
    return settings, trainable, logits


@pytest.mark.parametrize("tp", [2, 3])
def test_peft_written_adapter_loads_at_tp(peft_dir, tp):
    adapter, expected = peft_dir
    results = run_ranks(_load_at_tp, tp, tp, str(adapter), None, timeout=120)
    n_factors = 2 * len(TARGETS) * 2
    for settings, trainable, logits in results:
        assert settings == LoRASettings(R, float(ALPHA), 0.0, False)
        assert len(trainable) == n_factors and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_save_at_tp2_loads_in_peft(peft_dir, tmp_path):
    adapter, expected = peft_dir
    out = tmp_path / "saved"
    results = run_ranks(_load_at_tp, 2, 2, str(adapter), str(out), timeout=120)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden leftovers
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(TARGETS) and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (R, ALPHA, False)
    original = load_file(str(adapter / "adapter_model.safetensors"))
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(original)
    for key in original:
        assert torch.equal(saved[key], original[key]), key
    loaded = peft.PeftModel.from_pretrained(uneven_llama(), str(out)).eval()
    for key, tensor in original.items():  # the factors PEFT holds after loading our directory
        name = key.replace("lora_A.weight", "lora_A.default.weight").replace("lora_B.weight", "lora_B.default.weight")
        assert torch.equal(loaded.get_parameter(name), tensor), key
    with torch.no_grad():
        logits = loaded(input_ids=IDS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(results[0][2], logits, rtol=0, atol=1e-5)


def _merged_at_tp2(adapter):
    ctx = bd.init_parallel(tp=2)
    lm = bd.parallelize(uneven_llama(), tp_group=ctx.tp_group)
    bd.load_peft_adapter(lm, adapter)
    merge_lora_(lm)
    assert not any(".lora_" in n for n, _ in lm.named_parameters())
    full = {}
    for name, p in lm.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = lm.get_submodule(owner_name)
        full[name] = owner.gather_param(leaf) if isinstance(owner, TensorParallelModule) else p.detach().clone()
    return full


def test_merge_at_tp2_equals_peft_merge_and_unload(peft_dir):
    adapter, _ = peft_dir
    merged = run_ranks(_merged_at_tp2, 2, str(adapter), timeout=120)[0]
    expected = peft_model().merge_and_unload().state_dict()
    assert sorted(merged) == sorted(k for k in expected if k in dict(uneven_llama().named_parameters()))
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_plain_model_roundtrip_regex_and_settings(tmp_path):
    """tp=1, no process group: a regex ``target_modules`` (PEFT's rule), rsLoRA; a save of adapters
    bd.add_lora made on only some q_proj layers writes full names, which PEFT selects exactly."""
    pm = peft_model(targets=r".*\.0\.self_attn\.(q|v)_proj", use_rslora=True)
    pm.save_pretrained(str(tmp_path / "a"))
    lm = uneven_llama()
    settings = bd.load_peft_adapter(lm, tmp_path / "a")
    assert settings == LoRASettings(R, float(ALPHA), 0.0, True)
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=IDS).logits, pm(input_ids=IDS).logits, rtol=0, atol=1e-5)
    assert bd.load_peft_adapter(lm, tmp_path / "a") == settings  # adapters already there: same settings
    bd.save_peft_adapter(lm, tmp_path / "b")
    bd.save_peft_adapter(lm, tmp_path / "b")  # into an existing directory: each file replaced whole
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert config["use_rslora"] is True
    again = peft.PeftModel.from_pretrained(uneven_llama(), str(tmp_path / "b")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, pm(input_ids=IDS).logits, rtol=0, atol=1e-5)

    other = add_lora(uneven_llama(), r=2, alpha=2, targets=["q_proj"])
    with pytest.raises(CheckpointError, match=r"already has an adapter with LoRASettings\(r=2"):
        bd.load_peft_adapter(other, tmp_path / "a")


def _edited_copy(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_edit)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def _rename(tensors, old, new):
    tensors[new] = tensors.pop(old)


def test_bad_inputs_are_refused_by_name(peft_dir, tmp_path):
    adapter, _ = peft_dir
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/adapter_config\.json not found"):
        bd.load_peft_adapter(uneven_llama(), tmp_path / "empty")
    no_weights = _edited_copy(adapter, tmp_path / "noweights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors not found"):
        read_peft_adapter(no_weights)

    refused = {"dora": ({"use_dora": True}, "use_dora is True"), "bias": ({"bias": "all"}, "bias is 'all'"),
               "save": ({"modules_to_save": ["lm_head"]}, "modules_to_save is"),
               "ranks": ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is"),
               "alphas": ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern is"),
               "ia3": ({"peft_type": "IA3"}, "peft_type is 'IA3'")}
    for case, (edit, message) in refused.items():
        bad = _edited_copy(adapter, tmp_path / case, config_edit=edit)
        lm = uneven_llama()
        with pytest.raises(CheckpointError, match=message):
            bd.load_peft_adapter(lm, bad)
        assert not any(".lora_" in n for n, _ in lm.named_parameters())  # refused before any change

    stray = "base_model.model.model.layers.0.self_attn.nope_proj.lora_A.weight"
    bad = _edited_copy(adapter, tmp_path / "stray", tensors_edit=lambda t: (
        _rename(t, a_key, stray), _rename(t, a_key.replace("lora_A", "lora_B"), stray.replace("lora_A", "lora_B"))))
    with pytest.raises(CheckpointError, match=r"key 'base_model\.model\.model\.layers\.0\.self_attn\.nope_proj\.lora_A"
                                              r"\.weight' names no adapted module"):
        bd.load_peft_adapter(uneven_llama(), bad)

    bad = _edited_copy(adapter, tmp_path / "shape", tensors_edit=lambda t: t.update({a_key: torch.zeros(R, 35)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.lora_A\.weight': expected shape \(4, 36\), got \(4, 35\)"):
        bd.load_peft_adapter(uneven_llama(), bad)

    bad = _edited_copy(adapter, tmp_path / "half", tensors_edit=lambda t: t.pop(a_key.replace("lora_A", "lora_B")))
    with pytest.raises(CheckpointError, match=r"q_proj\.lora_B\.weight' is missing"):
        bd.load_peft_adapter(uneven_llama(), bad)

    bad = _edited_copy(adapter, tmp_path / "magnitude", tensors_edit=lambda t: t.update(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(36)}))
    with pytest.raises(CheckpointError, match=r"lora_magnitude_vector' is a DoRA magnitude vector"):
        bd.load_peft_adapter(uneven_llama(), bad)

    with pytest.raises(CheckpointError, match="has no LoRA adapter"):
        bd.save_peft_adapter(uneven_llama(), tmp_path / "none")


def tiny_gpt2():
    """GPT-2 (``Conv1D`` layers): the MLP converted (column/row Conv1D), attention left plain."""
    cfg = transformers.GPT2Config(vocab_size=61, n_embd=36, n_layer=2, n_head=6, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    cfg.base_model_tp_plan = {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _gpt2_at_tp2(adapter, out):
    ctx = bd.init_parallel(tp=2)
    lm = bd.parallelize(tiny_gpt2(), tp_group=ctx.tp_group)
    bd.load_peft_adapter(lm, adapter)
    with torch.no_grad():
        logits = lm(input_ids=IDS).logits
    bd.save_peft_adapter(lm, out)
    bd.merge_lora_(lm)  # converted and plain Conv1D layers, square c_proj among them, store (in, out)
    with torch.no_grad():
        merged = lm(input_ids=IDS).logits
    return logits, merged


def test_gpt2_conv1d_adapter_at_tp2(tmp_path):
    """PEFT's ``fan_in_fan_out`` adapter of GPT-2 (factors in the (r, in), (out, r) layout all the
    same) loads at tp=2 into converted and plain Conv1D layers, and is written back with
    ``fan_in_fan_out: true``; merged into those layers (`merge_lora_`), the same logits. Tolerances
    as for the Llama."""
    pm = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=R, lora_alpha=ALPHA, fan_in_fan_out=True,
                                                           target_modules=["c_attn", "c_proj", "c_fc"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        expected = pm.eval()(input_ids=IDS).logits
    pm.save_pretrained(str(tmp_path / "a"))
    logits, merged = run_ranks(_gpt2_at_tp2, 2, str(tmp_path / "a"), str(tmp_path / "b"), timeout=120)[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["target_modules"] == ["c_attn", "c_fc", "c_proj"]
    again = peft.PeftModel.from_pretrained(tiny_gpt2(), str(tmp_path / "b")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
