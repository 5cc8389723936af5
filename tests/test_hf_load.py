"""Reading a `save_pretrained` directory into a model converted by `bd.parallelize`
(`bigdense.checkpoint.hf_import.load_hf_weights`), and the ``model=hf`` config rules.

The reference is ``AutoModelForCausalLM.from_pretrained`` of the same directory, unsharded. The
converted model is built on the meta device as the job builds it, allocated, then filled by each
rank from its own slices. Logits of the same ids agree to 1e-5 relative (fp32: the row-parallel
layers' all-reduce sums the two halves of each dot product in another order than one matmul).
"""
import pytest
import torch

import bigdense as bd
from bigdense.checkpoint.hf_import import load_hf_weights
from bigdense.config import ConfigError, validate
from bigdense.config.schema import TrainConfig
from bigdense.layers.base import allocate_empty
from bigdense.models.hf_dir import HFDirectory
from bigdense.testing.pretrained import write_pretrained
from bigdense.testing.ranks import run_ranks

IDS = torch.randint(1, 500, (2, 12), generator=torch.Generator().manual_seed(3))


def _converted_logits(model_dir: str, tp: int):
    bd.init_parallel(tp=tp)
    lm = HFDirectory.open(model_dir).meta_model()  # as the job builds it (bigdense.jobs.build_hf)
    if tp > 1:
        lm = bd.parallelize(lm, tp_group=bd.get_default_context().tp_group)
    lm = allocate_empty(lm, "cpu")
    unused = load_hf_weights(lm, model_dir)
    tied = lm.lm_head.weight is lm.get_input_embeddings().weight
    with torch.no_grad():
        return lm(input_ids=IDS).logits, unused, tied


def _plain_logits(model_dir):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=IDS).logits


@pytest.mark.parametrize("kind, shard, tie", [("llama", "5GB", False), ("llama", "5GB", True), ("qwen3", "100KB", False),
                                             ("mixtral", "5GB", False), ("qwen3_moe", "200KB", False)])
@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_reads_its_shards_and_the_model_equals_from_pretrained(tmp_path, kind, shard, tie, tp):
    # 100KB/200KB: several safetensors files and an index, as big checkpoints come. The MoE
    # checkpoints store one tensor per expert, which transformers' rules merge into the model's
    # fused experts. A tied head is stored once and stays one parameter with the embedding.
    model_dir = write_pretrained(tmp_path / kind, kind, max_shard_size=shard, tie_word_embeddings=tie)
    assert (model_dir / "model.safetensors.index.json").exists() == (shard != "5GB")
    want = _plain_logits(model_dir)
    for got, unused, tied in run_ranks(_converted_logits, tp, str(model_dir), tp):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert unused == [] and tied == tie


def test_a_directory_of_another_model_is_refused_on_every_rank(tmp_path):
    small = write_pretrained(tmp_path / "small", "llama")
    other = write_pretrained(tmp_path / "other", "llama", hidden_size=64, intermediate_size=128, head_dim=16)
    (small / "model.safetensors").unlink()
    (small / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(Exception, match=r"has shape \[512, 64\], the model's 'model.embed_tokens.weight' needs \[512, 128\]"):
        run_ranks(_converted_logits, 2, str(small), 2)


def _cfg(**model):
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.name = "hf"
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def test_model_hf_config_rules_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.path must name a directory written by save_pretrained"):
        validate(_cfg(), 1, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json: not a save_pretrained directory"):
        validate(_cfg(path=str(tmp_path / "empty")), 1, "cpu")
    model_dir = write_pretrained(tmp_path / "m", "llama", max_position_embeddings=64)
    cfg = _cfg(path=str(model_dir))
    cfg.data.seq_len = 128
    with pytest.raises(ConfigError, match="data.seq_len=128 exceeds the model's max_position_embeddings=64"):
        validate(cfg, 1, "cpu")
    cfg.data.seq_len = 32
    assert validate(cfg, 2, "cpu").tp == 2
    cfg.parallel.sequence_parallel = True
    with pytest.raises(ConfigError, match="model=hf is converted by its own Hugging Face plan"):
        validate(cfg, 2, "cpu")
    gpt = _cfg()
    gpt.model.name, gpt.model.freeze_embeddings = "gpt", True
    with pytest.raises(ConfigError, match="model.freeze_embeddings applies to model=hf"):
        validate(gpt, 1, "cpu")
