"""The command that fine-tunes a compressed checkpoint, as `python -m bigdense.compress` prints it:
written as the docs write commands (``.venv/bin/torchrun --standalone --nproc_per_node=N
launch/train.py ...``, from the repository root) and runnable as printed.

N and the layout are those of the run that wrote the source checkpoint (a layout its model is known
to fit: ``parallel.tp`` is named where it is not every process). The other overrides are
``trainer.init_from``; what the fine-tune needs of the source run's settings: its ``model``,
``data`` and ``parallel`` keys that differ from `launch/train.py`'s defaults (so the weights load
into the same model and it trains on the same tokens), but the structure the fine-tune takes from
the checkpoint itself (`compressed_structure`); and a run directory beside the compressed checkpoint
(``OUT-ft``), so that the command resumes when run again.
"""
from __future__ import annotations

import re
from pathlib import Path

TORCHRUN = ".venv/bin/torchrun"
TRAIN = "launch/train.py"
GROUPS = ("model", "data", "parallel")  # the settings a fine-tune shares with the run it starts from
LAYOUT_KEYS = ("parallel.tp", "parallel.dp")  # from the layout the checkpoint records instead
# A string Hydra reads back as that string without quotes (not a number, bool or null, no grammar).
PLAIN = re.compile(r"[A-Za-z_./~][\w./~+-]*")


def fine_tune_command(source, out, world_size: int) -> list[str]:
    """The command's words (``shlex.join`` prints it) that fine-tune the checkpoint ``out``, written
    by compressing ``source``; ``world_size``: the processes to use where ``source`` records no layout."""
    from ..checkpoint.format import read_manifest

    layout = read_manifest(Path(source)).get("layout") or {}
    nproc = layout.get("world_size") or world_size
    tp = [f"parallel.tp={layout['tp']}"] if layout.get("tp", nproc) != nproc else []  # default: TP over all
    written = read_manifest(Path(out)).get("config") or {}
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", TRAIN, f"trainer.init_from={out}",
            *settings_overrides(written), *tp, f"trainer.run_dir={out}-ft"]


def settings_overrides(saved: dict) -> list[str]:
    """``key=value`` for every key of `GROUPS` whose value in the recorded config ``saved`` differs
    from `launch/train.py`'s default, leaving out what a run takes from the checkpoint itself and the
    layout (`fine_tune_command` names it from the checkpoint's record)."""
    from omegaconf import OmegaConf

    from ..jobs.setup import compressed_structure
    from ..plan.__main__ import DEFAULT_CONF, compose

    if not DEFAULT_CONF.is_dir():  # bigdense installed without its repository: no launch/train.py defaults to read
        return []
    default = OmegaConf.to_container(compose([], DEFAULT_CONF), resolve=True)
    taken = compressed_structure(saved)
    overrides = []
    for group in GROUPS:
        for name, value in (saved.get(group) or {}).items():
            key = f"{group}.{name}"
            if key in taken or key in LAYOUT_KEYS or name not in default.get(group, {}):
                continue
            if value != default[group][name]:
                overrides.append(f"{key}={hydra_value(value)}")
    return overrides


def hydra_value(value) -> str:
    """``value`` as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if PLAIN.fullmatch(text) and text.lower() not in ("true", "false", "null"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
