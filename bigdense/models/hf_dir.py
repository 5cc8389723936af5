"""A Hugging Face ``save_pretrained`` directory as the fine-tune job reads it (``model=hf
model.path=DIR``): its config, its tokenizer, and the files a run keeps beside its checkpoints so
that `bigdense.export_hf` can write a directory transformers loads. The rules for ``model.path``
are written here, once; `bigdense.config.validate` asks them.

Nothing is downloaded: transformers reads the directory with ``local_files_only``.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..data.tokenizer import TokenizerFile
from ..errors import ConfigError

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Weights are read from the source directory (and written by the job's checkpoints); every other
# file of the directory (config, generation config, tokenizer, chat template) is kept with a run.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class HFDirectory:
    """``path`` holds ``config.json`` (read as ``config``, a dict) and the weights."""

    path: Path
    config: dict

    @classmethod
    def open(cls, path, key: str = "model.path") -> "HFDirectory":
        """The directory at ``path``; a `ConfigError` naming ``key`` when it is none."""
        if path is None or str(path) in ("", "???"):
            raise ConfigError(f"{key} must name a directory written by save_pretrained (config.json and "
                              f"*.safetensors); got {path!r}")
        where = Path(str(path)).expanduser()
        if not where.is_dir():
            raise ConfigError(f"{key}={path!r} is not a directory (expected what save_pretrained writes)")
        try:
            config = json.loads((where / CONFIG).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{key}={path!r} has no {CONFIG}: not a save_pretrained directory (it holds "
                              f"{sorted(p.name for p in where.iterdir())[:8]})") from None
        except ValueError as err:
            raise ConfigError(f"{key}={path!r}: {CONFIG} is not JSON ({err})") from None
        if "model_type" not in config:
            raise ConfigError(f"{key}={path!r}: {CONFIG} names no model_type, so transformers cannot build it")
        return cls(where, config)

    def text_config(self) -> dict:
        """The language model's settings (a multimodal config nests them under ``text_config``)."""
        return self.config.get("text_config") or self.config

    @property
    def vocab_size(self) -> int:
        return int(self.text_config()["vocab_size"])

    @property
    def max_positions(self) -> Optional[int]:
        return self.text_config().get("max_position_embeddings")

    def auto_config(self):
        """transformers' config object of the directory (no network)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self.path), local_files_only=True)

    def meta_model(self):
        """transformers' causal LM of the directory's config with its parameters on the meta device
        (nothing allocated; fp32, the masters' dtype; computed buffers such as rotary frequencies
        real), its head tied to the embedding as the config says."""
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            lm = AutoModelForCausalLM.from_config(self.auto_config(), dtype=torch.float32)
        lm.tie_weights()  # init_empty_weights skips transformers' own tying
        return lm

    def tokenizer(self) -> Optional[TokenizerFile]:
        """The model's own tokenizer (``tokenizer.json``), None when the directory has none.
        Documents end with its end-of-sequence token (``tokenizer_config.json``'s ``eos_token``,
        else ``config.json``'s ``eos_token_id``)."""
        file = self.path / TOKENIZER
        if not file.exists():
            return None
        return TokenizerFile(file, self._eos_token(file), self.vocab_size)

    def _eos_token(self, file: Path) -> str:
        tok_cfg = self.path / TOKENIZER_CONFIG
        eos = json.loads(tok_cfg.read_text()).get("eos_token") if tok_cfg.exists() else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
        eos_id = self.text_config().get("eos_token_id", self.config.get("eos_token_id"))
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        if isinstance(eos_id, int):
            from tokenizers import Tokenizer

            token = Tokenizer.from_file(str(file)).id_to_token(eos_id)
            if token is not None:
                return token
        raise ConfigError(f"model.path={str(self.path)!r}: no end-of-sequence token to end documents with (neither "
                          f"{TOKENIZER_CONFIG}'s eos_token nor {CONFIG}'s eos_token_id names one in {TOKENIZER})")

    def metadata_files(self) -> list[Path]:
        """Every file of the directory but the weights: config, tokenizer, generation config."""
        return sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))

    def keep_beside(self, run_hf_dir: Path) -> None:
        """Copy `metadata_files` into ``run_hf_dir`` (a run's ``hf/``), where the export finds them
        even when the source directory has moved."""
        run_hf_dir.mkdir(parents=True, exist_ok=True)
        for file in self.metadata_files():
            shutil.copy2(file, run_hf_dir / file.name)
