"""The tokenizer of a run: byte-level BPE trained locally with the HuggingFace ``tokenizers``
library, or a model's own ``tokenizer.json`` (`TokenizerFile`, a fine-tuned Hugging Face model's).

Byte level means every string encodes (the 256 byte symbols are always in the vocabulary) and
``decode(encode(s)) == s`` exactly: no normalisation, no added prefix space. A model's own file
keeps whatever it defines; documents end with its end-of-sequence token.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EOT = "<|endoftext|>"  # ends every document in the token stream
MIN_VOCAB = 257  # the 256 bytes and EOT


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65536 entries, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def library_version() -> str:
    import tokenizers

    return tokenizers.__version__


@dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer that comes with the model (``tokenizer.json``), not trained on the corpus:
    ``eot`` ends each document (the model's end-of-sequence token), ``vocab_size`` is the model's
    embedding size, which must hold every id of the file."""

    path: Path
    eot: str
    vocab_size: int

    def digest(self) -> str:
        """What identifies the tokenizer in the data cache's key: its file's contents and ``eot``."""
        return hashlib.sha256(Path(self.path).read_bytes() + b"\0" + self.eot.encode()).hexdigest()

    def load(self) -> "BPETokenizer":
        return BPETokenizer.load(self.path, self.vocab_size, eot=self.eot)


class BPETokenizer:
    """Text <-> ids. ``vocab_size`` is the configured size, which the model's embedding and head use;
    ``trained_vocab_size`` (<= ``vocab_size``) is how many entries the tokenizer has (training may
    find fewer in a small corpus). Ids in between are never produced. ``eot`` ends every document."""

    def __init__(self, tokenizer, vocab_size: int, eot: str = EOT):
        self._tok = tokenizer
        self.trained_vocab_size = tokenizer.get_vocab_size()
        if self.trained_vocab_size > vocab_size:
            raise ValueError(f"the tokenizer has {self.trained_vocab_size} entries, more than the model's "
                             f"vocabulary of {vocab_size} (data.vocab_size, or a model's config.json vocab_size)")
        self.vocab_size = vocab_size
        self.eot = eot
        self.eot_id = tokenizer.token_to_id(eot)
        if self.eot_id is None:
            raise ValueError(f"the tokenizer has no {eot} token")

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int) -> "BPETokenizer":
        """Train on ``texts`` (the training split only). Deterministic for the same texts and version."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < MIN_VOCAB:
            raise ValueError(f"data.vocab_size must be >= {MIN_VOCAB} (256 bytes and {EOT}), got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer, length=len(texts))
        return cls(tok, vocab_size)

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int, eot: str = EOT) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), vocab_size, eot)

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids; ``add_special_tokens``: with what the tokenizer adds around a text (a
        model's beginning-of-sequence token, say), as ``transformers``' ``tokenizer(text)`` does."""
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        return [enc.ids for enc in encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_documents(self, texts: Sequence[str], chunk: int = 256) -> np.ndarray:
        """One flat array (``token_dtype(vocab_size)``): each document's ids followed by EOT.
        Encoded in chunks of documents, so the library's per-token objects never hold the whole corpus."""
        dtype = token_dtype(self.vocab_size)
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: faster
        eot = np.array([self.eot_id], dtype=dtype)
        parts = []
        for i in range(0, len(texts), chunk):
            for enc in encode_batch(list(texts[i:i + chunk]), add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(eot)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

