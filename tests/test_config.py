"""`bigdense.config.validate` asks each rule's owner: every enumerated option is refused with the
owner's list of choices, every range and combination with the key named, before any work.

The choices are compared with the owners' own definitions, so a new option added next to its
code is accepted by the config without a second edit (and one that is not is refused).
"""
import re

import pytest
from omegaconf import OmegaConf

from bigdense.config import ConfigError, TrainConfig, validate
from bigdense.data.corpus import SOURCES
from bigdense.layers.mlp import ACTIVATIONS
from bigdense.models import MODELS
from bigdense.train.engines.base import OPTIMIZERS
from bigdense.train.engines.deepspeed import ZERO_STAGES
from bigdense.train.engines.factory import ENGINES
from bigdense.train.precision import DTYPES
from bigdense.train.recompute import MODES
from bigdense.train.schedule import SCHEDULES


def _cfg(**overrides):
    cfg = OmegaConf.structured(TrainConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def test_the_defaults_validate():
    validate(_cfg(), 1, "cpu")


@pytest.mark.parametrize("key,choices", [
    ("model.name", MODELS), ("model.activation", ACTIVATIONS), ("recompute.mode", MODES),
    ("precision.dtype", DTYPES), ("engine.kind", ENGINES), ("optim.name", OPTIMIZERS),
    ("optim.schedule", SCHEDULES), ("data.source", SOURCES),
])
def test_each_option_accepts_its_owners_choices_and_refuses_others(key, choices):
    for choice in choices:
        if key == "data.source" and choice in ("files", "records"):
            continue  # needs data.path: a combination, checked below
        if key == "engine.kind" and choice == "deepspeed":
            continue  # DeepSpeed's own rules are checked below
        if key == "model.name" and choice == "hf":
            continue  # needs model.path: tests/test_hf_load.py
        validate(_cfg(**{key: choice}), 1, "cpu")
    with pytest.raises(ConfigError, match=re.escape(f"{key}='bogus' is not one of {list(choices)}")):
        validate(_cfg(**{key: "bogus"}), 1, "cpu")


@pytest.mark.parametrize("overrides,message", [
    ({"engine.kind": "deepspeed", "engine.zero_stage": 4}, re.escape(f"engine.zero_stage=4 is not one of {list(ZERO_STAGES)}")),
    # ZeRO-3 with TP is the FSDP engine's job: the message says so.
    ({"engine.kind": "deepspeed", "engine.zero_stage": 3}, r"engine.zero_stage=3: DeepSpeed does not train ZeRO-3 "
                                                           r"with tensor parallelism.*use engine=fsdp"),
    ({"engine.kind": "fsdp", "engine.dp_replicate": 0}, "engine.dp_replicate must be a positive integer"),
    ({"engine.kind": "deepspeed", "precision.dtype": "fp16"}, "precision=fp16 with engine=deepspeed needs a GPU"),
    ({"engine.bucket_cap_mb": 0.0}, "engine.bucket_cap_mb must be > 0"),
    ({"data.source": "files"}, "data.source=files needs data.path"),
    ({"data.source": "records"}, "data.source=records needs data.path"),
    ({"data.micro_batch_size": 0}, "data.micro_batch_size must be"),
    ({"data.grad_accum": 0}, "data.grad_accum must be a positive integer"),
    ({"trainer.max_steps": 0}, "trainer.max_steps must be a positive integer"),
    ({"recompute.mode": "every_k", "recompute.every": 0}, "recompute.every must be a positive integer"),
    ({"precision.growth_interval": 0}, "precision.growth_interval must be a positive integer"),
    ({"optim.lr": 0.0}, "optim.lr must be > 0"),
    ({"optim.min_lr": 1.0}, r"optim.min_lr must be in \[0, optim.lr="),
    ({"optim.betas": [0.9, 1.0]}, r"optim.betas must be two numbers in \[0, 1\)"),
    ({"parallel.tp": 3}, r"parallel.tp=3 does not divide the number of processes \(2\)"),
    ({"parallel.tp": 2, "parallel.dp": 2}, r"parallel.tp \(2\) x parallel.dp \(2\) = 4"),
    ({"model.n_heads": 3, "model.d_model": 12}, "parallel.tp=2 must divide model.n_heads=3"),
    ({"model.head_chunk_size": 0}, "model.head_chunk_size must be > 0"),
])
def test_ranges_and_combinations_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**overrides), 2, "cpu")


def test_head_chunk_size_null_leaves_the_chunk_to_the_head():
    validate(_cfg(**{"model.head_chunk_size": None}), 1, "cpu")
