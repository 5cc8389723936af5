"""Unknown config keys stop the run, naming the closest valid key, for plain and `+` overrides and
for keys in option files, in every group."""
import pytest
from hydra import compose, initialize_config_dir

from bigdense.config import (
    ConfigError, TrainConfig, check_known_keys, check_override_keys, register_configs, schema_keys, validate,
)
from helpers import ROOT

# One misspelling per group, and the key it should suggest.
TYPOS = {
    "model.d_modle": "model.d_model",
    "recompute.mod": "recompute.mode",
    "parallel.tpp": "parallel.tp",
    "precision.dtyp": "precision.dtype",
    "engine.zero_stages": "engine.zero_stage",
    "optim.warmup_step": "optim.warmup_steps",
    "data.seq_length": "data.seq_len",
    "trainer.max_step": "trainer.max_steps",
    "trainer.lr": "optim.lr",  # the right name in the wrong group
}


def compose_with(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_schema_keys_come_from_the_dataclasses():
    keys = schema_keys()
    assert keys["trainer"] is True and keys["trainer.max_steps"] is False
    assert set(k for k, group in keys.items() if group) == {f for f in TrainConfig.__dataclass_fields__}


@pytest.mark.parametrize("typo,suggestion", sorted(TYPOS.items()))
def test_plain_and_plus_override_typos_name_the_closest_key(typo, suggestion):
    for prefix in ("", "+", "++"):
        with pytest.raises(ConfigError, match=rf"^{typo} is not a config key; did you mean {suggestion}\?"):
            check_override_keys([f"{prefix}{typo}=3"])


@pytest.mark.parametrize("typo,suggestion", sorted(TYPOS.items()))
def test_composed_config_with_an_appended_typo_fails_validation(typo, suggestion):
    cfg = compose_with(f"+{typo}=3")  # Hydra accepts it: the key is appended to the struct config
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        validate(cfg, world_size=1, device_type="cpu")


def test_valid_overrides_pass():
    check_override_keys(["model=gpt_small", "trainer.max_steps=3", "+trainer.max_steps=3", "optim.lr=1e-3,3e-4",
                         "hydra.run.dir=/tmp/x", "hydra/job_logging=disabled", "--multirun", "~trainer.plot", "optim.betas=[0.9,0.99]"])
    check_known_keys(compose_with("model=gpt_swiglu", "trainer.max_steps=3"))


def test_an_unknown_key_with_nothing_close_still_names_the_key():
    with pytest.raises(ConfigError, match=r"^banana is not a config key \(every key"):
        check_override_keys(["+banana=1"])
