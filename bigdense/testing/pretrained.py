"""A small Hugging Face checkpoint with its tokenizer, written by ``save_pretrained``: what the
fine-tune job (``launch/train.py model=hf model.path=DIR``) reads, made on this machine without
a download, for the tests and for trying the job.

    .venv/bin/python -m bigdense.testing.pretrained outputs/tiny-llama                 # a Llama-style one
    .venv/bin/python -m bigdense.testing.pretrained outputs/tiny-qwen3 --model-type qwen3

The weights are random (seeded): fine-tuning them shows the job working, not a useful model. The
tokenizer is a byte-level BPE trained on a few of this Python's own standard-library files (the
job's default corpus), saved as ``tokenizer.json`` with ``</s>`` as its end-of-sequence token and a
small chat template (`CHAT_TEMPLATE`) that marks the assistant's tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import sysconfig
from pathlib import Path
from unittest import mock

import torch

EOS = "</s>"
# A small chat template in the field's form: turns between role markers, the assistant's content and its
# end-of-sequence token inside {% generation %} (which lets transformers mark the assistant's tokens), an
# unknown role refused.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# A few standard-library files: text every machine has, the same for the same Python.
TOKENIZER_TEXTS = ("json/decoder.py", "json/encoder.py", "textwrap.py", "argparse.py", "functools.py")
# The shape of the model `python -m bigdense.testing.pretrained` writes (small enough to train on a CPU).
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
# What MoE configs add: experts small enough for a test, two of four chosen per token.
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def train_tokenizer(vocab_size: int):
    """A ``transformers`` fast tokenizer (byte-level BPE with ``</s>``) of ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(lib / name).read_text(encoding="utf-8") for name in TOKENIZER_TEXTS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=CHAT_TEMPLATE)


def write_pretrained(directory, model_type: str = "llama", *, vocab_size: int = 512, seed: int = 0,
                     max_shard_size: str = "5GB", **overrides) -> Path:
    """Write a randomly initialised (``seed``) causal LM of ``model_type`` and its tokenizer into
    ``directory`` with ``save_pretrained``; ``overrides`` change the config (`SMALL`'s shape unless
    given; an MoE config also takes `MOE`'s sizes). Returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer(vocab_size)
    config = AutoConfig.for_model(model_type)
    known = config.to_dict()
    settings = {k: v for k, v in {**SMALL, **MOE}.items() if k in known}
    settings.update(overrides)
    settings.update(vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = Path(directory)
    with _no_unwrapping():
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def _no_unwrapping():
    """``save_pretrained`` first unwraps the model from distributed wrappers through accelerate,
    which imports DeepSpeed to know its wrapper whenever DeepSpeed is installed (and DeepSpeed
    prints "Setting accelerator to CPU" as it loads). The model saved here was built a line
    earlier and wrapped in nothing, so unwrapping is the identity: nothing here uses DeepSpeed."""
    from transformers import modeling_utils

    if not hasattr(modeling_utils, "unwrap_model"):  # a transformers that saves otherwise: nothing to step around
        yield
        return
    with mock.patch.object(modeling_utils, "unwrap_model", lambda model, recursive=False: model):
        yield


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bigdense.testing.pretrained", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--model-type", default="llama", help="a transformers model_type (llama, qwen3, mixtral, ...)")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_pretrained(args.directory, args.model_type, vocab_size=args.vocab_size, seed=args.seed)
    print(describe_written(out, args.model_type, args.vocab_size, args.seed))
    return 0


def describe_written(out: Path, model_type: str, vocab_size: int, seed: int) -> str:
    """What `main` wrote, and the command that fine-tunes it (docs/training.md's)."""
    files = sorted(p.name for p in out.iterdir())
    return (f"wrote {out}: a {model_type} causal LM with random weights (seed {seed}) and its {vocab_size}-entry "
            f"tokenizer ({EOS} ends a sequence), written by save_pretrained: {', '.join(files)}\n"
            f"fine-tune it: .venv/bin/torchrun --standalone --nproc_per_node=2 launch/train.py model=hf "
            f"model.path={out} optim=finetune")


if __name__ == "__main__":
    raise SystemExit(main())
