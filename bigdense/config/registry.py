"""Hydra's side of the configuration: the schemas registered with its ConfigStore, and the
``bd_run_dir`` resolver that names a run's directory."""
from __future__ import annotations

import os
from typing import Optional

from .schema import TrainConfig


def run_dir_name(run_dir: Optional[str] = None) -> str:
    """The run directory: ``trainer.run_dir`` when set, else a name under ``outputs/`` that is the
    same on every rank of one launch and across its restarts.

    Under torchrun it is the whole rendezvous id, and nothing else (``--standalone`` makes a fresh
    one per launch; restarts, requeues and relaunches with the same ``--rdzv-id`` keep it, even past
    midnight, so the job finds its own checkpoints); alone, the date and time.
    """
    import re
    import time

    if run_dir:
        return str(run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return "outputs/torchrun-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    return time.strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (``conf/config.yaml`` extends ``_train_schema``)
    and the ``bd_run_dir`` resolver the run directory uses."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("bd_run_dir"):
        OmegaConf.register_new_resolver("bd_run_dir", run_dir_name, use_cache=True)
    ConfigStore.instance().store(name="_train_schema", node=TrainConfig)
