"""``python -m bigdense.plan [OVERRIDES...] [plan.KEY=VALUE...] [--suggest] [--json PATH]``

Takes the training job's Hydra config (``conf/``, the same overrides as `launch/train.py`) and the
devices (``plan.device_gb``, ``plan.devices``, ... documented in `bigdense.config.PlanConfig`),
prints the per-rank memory table, and with ``--suggest`` the layouts that fit, fastest first, each
as the overrides to paste into ``torchrun launch/train.py``. ``--json PATH`` writes it all.

    python -m bigdense.plan model=gpt_small parallel.tp=2 parallel.dp=4 precision=bf16 plan.device_gb=80
    python -m bigdense.plan model=gpt_small plan.devices=8 plan.device_gb=24 --suggest
    python -m bigdense.plan model=hf model.path=DIR parallel.tp=2      # a Hugging Face fine-tune
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import ConfigError, PlanConfig, register_configs
from .config import estimate_config, suggest
from .estimate import GiB
from .layout import Layout

DEFAULT_CONF = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str], config_dir: Path):
    """The training config ``launch/train.py`` would see with these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.plan", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training config, and plan.KEY=VALUE")
    parser.add_argument("--suggest", action="store_true", help="rank the layouts that fit")
    parser.add_argument("--json", type=Path, help="write the estimate (and suggestions) here")
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONF, help="the training job's conf/")
    args = parser.parse_args(argv)
    plan_items = [o for o in args.overrides if o.startswith("plan.")]
    train_items = [o for o in args.overrides if not o.startswith("plan.")]
    try:
        plan = OmegaConf.merge(OmegaConf.structured(PlanConfig),
                               OmegaConf.from_dotlist([o[len("plan."):] for o in plan_items]))
    except OmegaConfBaseException as err:
        keys = [f"plan.{f}" for f in PlanConfig.__dataclass_fields__]
        raise ConfigError(f"{' '.join(plan_items)}: {str(err).splitlines()[0]}; the plan keys are {keys}") from None
    return args, train_items, plan


def main(argv=None) -> int:
    suggestions = []
    try:
        args, train_items, plan = parse(sys.argv[1:] if argv is None else argv)
        cfg = compose(train_items, args.config_dir)
        suggestions = suggest(cfg, plan) if args.suggest else []
        est = estimate_config(cfg, plan)
    except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as err:
        if not suggestions:
            print(f"bigdense.plan: bad config: {err}", file=sys.stderr)
            return 2
        est = None
        print(f"the config as given is refused ({err}); layouts that would work:")
    device = plan.device_gb * GiB
    if est is not None:
        print(est.table(device))
    if args.suggest:
        devices = suggestions[0].layout.tp * suggestions[0].layout.dp if suggestions else "?"
        print(f"\n{len(suggestions)} layouts fit {plan.device_gb:g} GiB x {devices} devices "
              f"(fastest first; estimated step time, peak per rank; every one at precision={cfg.precision.dtype}: "
              f"precision is not searched):")
        kept = [o for o in train_items if not Layout.sets(o)]  # the model, the data: the same in every layout
        for rank, s in enumerate(suggestions[: plan.top], 1):
            print(f"{rank:3d}. {s.step_time_s * 1e3:9.1f} ms  {s.total_bytes / GiB:7.2f} GiB  "
                  f"torchrun launch/train.py {' '.join(kept + s.layout.overrides())}")
    if args.json:
        out = {"overrides": train_items, "plan": OmegaConf.to_container(plan), "estimate": est and est.to_json(),
               "suggestions": [s.to_json() for s in suggestions]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
