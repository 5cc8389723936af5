"""The three record shapes, recognised from a table's fields or named by the ``data.*_field`` keys,
and each record checked before anything is tokenised:

- text (``{"text": ...}``): every token a target;
- prompt and completion (``{"prompt": ..., "completion": ...}``): the completion's tokens targets;
- messages (``{"messages": [{"role": ..., "content": ...}, ...]}``): the assistant turns' tokens
  targets, as the model's chat template marks them.

A record that breaks its shape's rules is reported with its file, line or row and field
(`Problems`). The checked records leave as `Examples`: plain Python values, in file order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...errors import ConfigError
from .sources import Problems, RecordFile

TEXT, PROMPT_COMPLETION, MESSAGES = "text", "prompt_completion", "messages"
# The fields a shape is recognised by when no data.*_field key names them, in this order.
DEFAULT_FIELDS = {MESSAGES: ("messages",), PROMPT_COMPLETION: ("prompt", "completion"), TEXT: ("text",)}
ASSISTANT = "assistant"


@dataclass(frozen=True)
class Shape:
    kind: str
    fields: tuple[str, ...]


def named_shape(cfg) -> Optional[Shape]:
    """The shape the ``data.*_field`` keys name, or None (recognised per table)."""
    named = []
    if cfg.messages_field:
        named.append(Shape(MESSAGES, (cfg.messages_field,)))
    if cfg.prompt_field or cfg.completion_field:
        named.append(Shape(PROMPT_COMPLETION, (cfg.prompt_field or "prompt", cfg.completion_field or "completion")))
    if cfg.text_field:
        named.append(Shape(TEXT, (cfg.text_field,)))
    if len(named) > 1:
        raise ConfigError("name one record shape: data.text_field, data.prompt_field/data.completion_field or "
                          f"data.messages_field, not {[s.kind for s in named]}")
    return named[0] if named else None


def table_shape(cfg, columns: list[str], source: RecordFile) -> Shape:
    """``cfg``'s named shape, its fields checked against ``columns``; else the first shape of
    `DEFAULT_FIELDS` whose fields are all there."""
    shape = named_shape(cfg)
    if shape is not None:
        missing = [f for f in shape.fields if f not in columns]
        if missing:
            raise ConfigError(f"{source.where(0)}, field {missing[0]!r}: no such field (its fields: {columns}); the "
                              "data.*_field keys name the fields of the record shape")
        return shape
    for kind, fields in DEFAULT_FIELDS.items():
        if all(f in columns for f in fields):
            return Shape(kind, fields)
    raise ConfigError(f"{source.where(0)}: no record shape in the fields {columns}: expected 'text', 'prompt' and "
                      "'completion', or 'messages' (or name yours with data.text_field, data.prompt_field/"
                      "data.completion_field, data.messages_field)")


@dataclass
class Examples:
    """Checked records of one split, in order: ``values[i]`` is a text, a (prompt, completion) pair
    or a message list, of ``kinds[i]``; ``places[i]`` says where it came from (for later errors)."""

    kinds: list[str] = field(default_factory=list)
    values: list = field(default_factory=list)
    places: list[tuple[RecordFile, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, kind: str, value, place: tuple[RecordFile, int]) -> None:
        self.kinds.append(kind)
        self.values.append(value)
        self.places.append(place)

    def take(self, keep: list[bool]) -> "Examples":
        out = Examples()
        for k, v, p, kept in zip(self.kinds, self.values, self.places, keep):
            if kept:
                out.add(k, v, p)
        return out

    def where(self, i: int) -> str:
        source, row = self.places[i]
        return source.where(row)


def check_records(cfg, tables, problems: Problems) -> Examples:
    """Every record of ``tables`` (``[(RecordFile, Dataset)]``) checked by its table's shape."""
    out = Examples()
    for source, table in tables:
        shape = table_shape(cfg, list(table.column_names), source)
        columns = table.select_columns(list(shape.fields)).to_dict()  # whole columns: row access is slow
        for row, values in enumerate(zip(*(columns[f] for f in shape.fields))):
            value = _checked(shape, values, cfg.train_on_prompt, source, row, problems)
            if value is not None:
                out.add(shape.kind, value, (source, row))
    return out


def _checked(shape: Shape, values: tuple, train_on_prompt: bool, source: RecordFile, row: int, problems: Problems):
    for name, value in zip(shape.fields, values):
        if shape.kind != MESSAGES and not isinstance(value, str):
            problems.report(f"{source.where(row)}, field {name!r}: expected a string, got {_what(value)}")
            return None
    if shape.kind == TEXT:
        return values[0]
    if shape.kind == PROMPT_COMPLETION:
        return values
    return _checked_messages(values[0], train_on_prompt, source, row, shape.fields[0], problems)


def _checked_messages(messages, train_on_prompt: bool, source: RecordFile, row: int, name: str, problems: Problems):
    where = f"{source.where(row)}, field {name!r}"
    if not isinstance(messages, list) or not messages:
        problems.report(f"{where}: expected a non-empty list of {{'role': ..., 'content': ...}}, got {_what(messages)}")
        return None
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            value = m.get(key) if isinstance(m, dict) else None
            if not isinstance(value, str):
                problems.report(f"{where}[{i}][{key!r}]: expected a string, got {_what(value)}")
                return None
    if not train_on_prompt and not any(m["role"] == ASSISTANT for m in messages):
        problems.report(f"{where}: no {ASSISTANT!r} turn, so nothing to train on (roles: "
                        f"{[m['role'] for m in messages]})")
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _what(value) -> str:
    return "nothing (the field is missing or null)" if value is None else f"a {type(value).__name__} ({str(value)[:40]!r})"


def held_out(n: int, fraction: float) -> list[bool]:
    """Which of ``n`` records a fraction of the split holds out: spread evenly over them (record ``i``
    when ``floor((i + 1) * f)`` passes an integer), ``round(n * f)`` in all, at least one."""
    picks = [int((i + 1) * fraction) > int(i * fraction) for i in range(n)]
    if n > 1 and not any(picks):
        picks[-1] = True
    return picks
