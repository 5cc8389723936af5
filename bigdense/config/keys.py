"""Config keys no schema defines: a typo stops the run before work, naming the closest valid key.

`check_override_keys` reads the command line before Hydra composes it (a plain misspelt key would
otherwise get Hydra's hint to append it with ``+``, which is then accepted); `check_known_keys`
walks the composed config (a ``+`` override, or a typo in an option file). Both name the closest key
that the schemas (`bigdense.config.schema`) define (`unknown_key_error`).
"""
from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from typing import Iterable

from ..errors import ConfigError
from .schema import TrainConfig


def schema_keys(schema=None, prefix: str = "") -> dict[str, bool]:
    """Every dotted key the schemas define (``schema``: `TrainConfig` unless given), read from the
    dataclasses: ``{key: is_group}``."""
    if schema is None:
        schema = TrainConfig
    keys = {}
    for f in fields(schema):
        key = prefix + f.name
        nested = f.default_factory if is_dataclass(f.default_factory) else None
        keys[key] = nested is not None
        if nested is not None:
            keys.update(schema_keys(nested, key + "."))
    return keys


def key_hints(schema=None, prefix: str = "") -> dict[str, str]:
    """``{key: hint}``: what a key does, for the keys whose schema field says it (``metadata["hint"]``,
    read after the key's name), where a name close to a typo could be taken for something else
    (``model.low_rank`` for adapters)."""
    if schema is None:
        schema = TrainConfig
    hints = {}
    for f in fields(schema):
        if "hint" in f.metadata:
            hints[prefix + f.name] = f.metadata["hint"]
        if is_dataclass(f.default_factory):
            hints.update(key_hints(f.default_factory, prefix + f.name + "."))
    return hints


def unknown_key_error(key: str) -> ConfigError:
    """`ConfigError` for a key no schema defines, naming the closest valid key: the same name in
    another group (trainer.lr -> optim.lr), else a close one in the same group (trainer.max_step ->
    trainer.max_steps), else a close name anywhere (modle.d_model -> model.d_model); with what that
    key is, when its schema field gives a hint (`key_hints`)."""
    valid = schema_keys()
    group, _, leaf = key.rpartition(".")
    in_group = [k for k in valid if group and k.startswith(group + ".")]
    by_leaf = {k.rpartition(".")[2]: k for k in valid if not valid[k]}
    close = ([by_leaf[leaf]] if leaf in by_leaf else
             (difflib.get_close_matches(key, in_group, n=1, cutoff=0.6)
              or [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)]
              or difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)))
    hint = f"; did you mean {close[0]}?" if close else ""
    what = key_hints().get(close[0]) if close else None
    if what:
        hint += f" {close[0]} {what}"
    return ConfigError(f"{key} is not a config key{hint} (every key is documented in bigdense/config/schema.py)")


def check_known_keys(cfg) -> None:
    """Stop on any key of the composed config that no schema defines (a ``+trainer.max_step=10``
    Hydra accepted, or a typo in an option file), naming the closest valid key."""
    if is_dataclass(cfg):  # a TrainConfig object holds its schema's keys only
        return
    valid = schema_keys()

    def walk(node, prefix: str) -> None:
        for name in node.keys():
            key = prefix + str(name)
            if key not in valid:
                raise unknown_key_error(key)
            if valid[key]:
                walk(node[name], key + ".")

    walk(cfg, "")


def check_override_keys(overrides: Iterable[str]) -> None:
    """Check the keys of command-line overrides before Hydra composes: a plain ``trainer.max_step=10``
    would otherwise fail with Hydra's hint to append it with ``+``, which is then accepted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in overrides if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001 -- malformed: Hydra's own parser reports it, with position
        return
    valid = schema_keys()
    for override in parsed:
        key = override.key_or_group  # a group path with "/" (hydra/job_logging) is Hydra's to check
        if override.package is None and "/" not in key and key.split(".")[0] != "hydra" and key not in valid:
            raise unknown_key_error(key)
