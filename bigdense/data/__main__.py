"""``python -m bigdense.data show OVERRIDES [--split train|val] [--rows N] [--json FILE]``

The rows a training job would see, with the same overrides as `launch/train.py`, in training order
(the held-out rows in theirs): each row decoded, its target tokens between ``[[`` and ``]]``; with
``--json FILE`` one JSON object per row, ``{"x": [...], "y": [...]}`` (token ids, ``-100`` where a
token is not a target). Every row of an epoch by default. Check the masking here before training:

    python -m bigdense.data show data=records data.path=chats.jsonl model=hf model.path=DIR --rows 4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ..config import ConfigError, validate
from ..jobs.models import model_tokenizer
from ..plan.__main__ import DEFAULT_CONF, compose
from . import prepare_data
from .records import IGNORE_INDEX

OPEN, CLOSE = "[[", "]]"


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.data", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["show"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    parser.add_argument("--split", choices=["train", "val"], default="train")
    parser.add_argument("--rows", type=int, default=None, help="rows to show (default: every row of an epoch)")
    parser.add_argument("--json", type=Path, help="write the rows here, one JSON object per line")
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONF, help="the training job's conf/")
    return parser.parse_args(argv)


class _OneProcess:
    dp_rank, dp_size = 0, 1


def render(tokenizer, x, y) -> str:
    """A row as text: the inputs and the last target, target tokens between `OPEN` and `CLOSE`."""
    tokens = list(x) + [y[-1] if y[-1] != IGNORE_INDEX else x[-1]]
    is_target = [False] + [t != IGNORE_INDEX for t in y]
    out, start = [], 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or is_target[i] != is_target[start]:
            text = tokenizer.decode(tokens[start:i])
            out.append(f"{OPEN}{text}{CLOSE}" if is_target[start] else text)
            start = i
    return "".join(out)


def show(args, cfg) -> int:
    data = prepare_data(cfg.data, _OneProcess, seed=cfg.trainer.seed, tokenizer=model_tokenizer(cfg))
    if not hasattr(data, "train"):
        raise ConfigError("python -m bigdense.data show reads records (data=records): data.source="
                          f"{cfg.data.source!r} trains on every token of random windows")
    rows = data.train if args.split == "train" else data.val
    n = rows.rows_per_epoch(0) if args.rows is None else args.rows
    print(data.describe())
    out = args.json.open("w") if args.json else None
    try:
        for g in range(n):
            x, y = (a.tolist() for a in rows.row(g))
            if out is not None:
                out.write(json.dumps({"x": x, "y": y}) + "\n")
            if args.rows is not None or args.json is None:
                targets = sum(t != IGNORE_INDEX for t in y)
                print(f"--- {args.split} row {g} ({targets} targets of {len(y)})\n{render(data.tokenizer, x, y)}")
    finally:
        if out is not None:
            out.close()
            print(f"written: {args.json} ({n} rows)")
    return 0


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose(args.overrides, args.config_dir)
        validate(cfg, 1, "cpu")
        return show(args, cfg)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"bigdense.data: bad config: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
