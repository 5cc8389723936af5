"""Checked records to tokens: each example's ids and which of them are targets.

- text: the text's ids (with what the tokenizer adds around a text), then the end-of-sequence token;
- prompt and completion: the prompt's ids (as a text's), the completion's (nothing added), the
  end-of-sequence token; the completion and that token are targets. The two are tokenised apart,
  so the prompt's length is exact (a merge across the boundary cannot hide it);
- messages: the model directory's chat template rendered by ``transformers``
  (``apply_chat_template(..., return_assistant_tokens_mask=True)``), the assistant tokens it marks
  targets; the end-of-sequence token is added when the rendering does not end with it.

No example's first token is a target: nothing before it in the example predicts it (the rows it is
packed into mask it too). ``data.train_on_prompt=true`` makes every other token a target.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ..tokenizer import BPETokenizer, token_dtype
from .shapes import MESSAGES, PROMPT_COMPLETION, TEXT, Examples
from .sources import Problems

CHUNK = 1024  # texts per call of the tokenizer's batch encoder


@dataclass
class Encoded:
    """One split's examples: ``tokens[offsets[i]:offsets[i + 1]]`` is example ``i``, ``targets`` (uint8)
    marks its target tokens."""

    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class RecordTokenizer:
    """The run's tokenizer for records; ``model_dir`` (a Hugging Face model's) has the chat template."""

    def __init__(self, tokenizer: BPETokenizer, model_dir: Optional[Path]):
        self.tokenizer, self.model_dir, self._chat = tokenizer, model_dir, None

    def chat(self):
        """``transformers``' tokenizer of ``model_dir``, which renders its chat template; refused (a
        `ConfigError` saying why and what to do) when there is none or it cannot mark assistant turns."""
        if self._chat is None:
            if self.model_dir is None:
                raise ConfigError("records with messages need a chat template, and the reference GPT's tokenizer "
                                  "(trained on the records) has none: fine-tune a Hugging Face model (model=hf "
                                  "model.path=DIR) or give prompt/completion records")
            from transformers import AutoTokenizer

            chat = AutoTokenizer.from_pretrained(str(self.model_dir))
            template = chat.chat_template if isinstance(chat.chat_template, str) else None
            if not template:
                raise ConfigError(f"model.path={str(self.model_dir)!r}: tokenizer_config.json has no chat_template, so "
                                  "records with messages cannot be rendered: add one, or give prompt/completion records")
            self._chat = (chat, "{% generation %}" in template.replace("{%-", "{%").replace(" -%}", " %}"))
        return self._chat

    def render(self, messages: list[dict], train_on_prompt: bool) -> tuple[list[int], list[int]]:
        chat, marks = self.chat()
        if not (marks or train_on_prompt):
            raise ConfigError(f"model.path={str(self.model_dir)!r}: its chat template has no {{% generation %}} "
                              "markers, so transformers cannot tell the assistant's tokens from the rest: add them "
                              "around the assistant's content (docs/training.md, 'Records'), or set "
                              "data.train_on_prompt=true to train on every token")
        out = chat.apply_chat_template(messages, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=marks)
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"]) if marks else [1] * len(ids)
        return ids, mask


def encode_examples(examples: Examples, tok: RecordTokenizer, train_on_prompt: bool, problems: Problems) -> Encoded:
    """``examples`` tokenised; a conversation the template refuses (a role it does not know, say) is a
    bad record, reported with its place."""
    ids: list = [None] * len(examples)
    runs: list = [None] * len(examples)  # (lengths, flags) of runs of equal target flags
    eos = tok.tokenizer.eot_id
    by_kind = {k: [i for i, kind in enumerate(examples.kinds) if kind == k] for k in (TEXT, PROMPT_COMPLETION, MESSAGES)}
    for i, text_ids in zip(by_kind[TEXT], _encode(tok, [examples.values[i] for i in by_kind[TEXT]], True)):
        ids[i], runs[i] = text_ids + [eos], ((len(text_ids) + 1,), (1,))
    pcs = by_kind[PROMPT_COMPLETION]
    prompts = _encode(tok, [examples.values[i][0] for i in pcs], True)
    completions = _encode(tok, [examples.values[i][1] for i in pcs], False)
    for i, p, c in zip(pcs, prompts, completions):
        ids[i], runs[i] = p + c + [eos], ((len(p), len(c) + 1), (int(train_on_prompt), 1))
    for i in by_kind[MESSAGES]:
        try:
            chat_ids, mask = tok.render(examples.values[i], train_on_prompt)
        except ConfigError:  # the template itself is refused: every record would be
            raise
        except Exception as e:  # noqa: BLE001 -- the template's own refusal (jinja's raise_exception, ...)
            problems.report(f"{examples.where(i)}, field 'messages': the chat template refuses it: {e}")
            continue
        if not chat_ids or chat_ids[-1] != eos:
            chat_ids, mask = chat_ids + [eos], mask + [mask[-1] if mask else 0]
        ids[i], runs[i] = chat_ids, _runs(mask)
    return _pack_arrays([x for x in ids if x is not None], [r for r in runs if r is not None],
                        tok.tokenizer.vocab_size, train_on_prompt)


def _encode(tok: RecordTokenizer, texts: list[str], special: bool) -> list[list[int]]:
    return [ids for i in range(0, len(texts), CHUNK) for ids in tok.tokenizer.encode_batch(texts[i:i + CHUNK], special)]


def _runs(mask: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    groups = [(len(list(g)), int(bool(flag))) for flag, g in itertools.groupby(mask)]
    return tuple(n for n, _ in groups), tuple(f for _, f in groups)


def _pack_arrays(ids: list[list[int]], runs: list, vocab_size: int, train_on_prompt: bool) -> Encoded:
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=token_dtype(vocab_size), count=int(offsets[-1]))
    if train_on_prompt:
        targets = np.ones(len(tokens), dtype=np.uint8)
    else:
        run_lengths = np.fromiter(itertools.chain.from_iterable(r[0] for r in runs), dtype=np.int64)
        run_flags = np.fromiter(itertools.chain.from_iterable(r[1] for r in runs), dtype=np.uint8)
        targets = np.repeat(run_flags, run_lengths)
    targets[offsets[:-1][lengths > 0]] = 0  # an example's first token: nothing in the example predicts it
    return Encoded(tokens, targets, offsets)
