"""What a new user is told on the way: a typo whose closest key could be mistaken for something else
says what that key is (``model.low_rank`` is no adapter), and ``python -m bigdense.testing.pretrained``
says what it wrote and how to fine-tune it."""
import pytest

from bigdense.config import ConfigError
from bigdense.config.keys import check_override_keys, key_hints


@pytest.mark.parametrize("typo", ["model.lora_rank", "model.lora", "model.lowrank"])
def test_a_typo_near_low_rank_says_it_is_no_adapter(typo):
    with pytest.raises(ConfigError) as err:
        check_override_keys([f"{typo}=8"])
    said = str(err.value)
    assert said.startswith(f"{typo} is not a config key; did you mean model.low_rank? model.low_rank builds the "
                           "named dense layers as low-rank pairs, as `python -m bigdense.compress` writes them"), said
    assert "it adds no adapters (low-rank adapters beside frozen layers are the lora group: lora.r=16)" in said
    assert "\n" not in said


def test_a_key_without_a_hint_is_suggested_as_before():
    assert "trainer.max_steps" not in key_hints()
    with pytest.raises(ConfigError, match=r"^trainer\.max_step is not a config key; did you mean trainer\.max_steps\? "
                                          r"\(every key is documented"):
        check_override_keys(["trainer.max_step=3"])


def test_the_pretrained_command_says_what_it_wrote(tmp_path, capsys):
    from bigdense.testing.pretrained import main

    out = tmp_path / "tiny-llama"
    assert main([str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "tokenizer.json" in files and any(f.endswith(".safetensors") for f in files)
    assert said == [f"wrote {out}: a llama causal LM with random weights (seed 0) and its 512-entry tokenizer (</s> "
                    f"ends a sequence), written by save_pretrained: {', '.join(files)}",
                    f"fine-tune it: .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py model=hf "
                    f"model.path={out} optim=finetune"], said
