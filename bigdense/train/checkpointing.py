"""The training job's checkpoints: periodic saves (asynchronous by default), retention, what a
failed save does, resuming, and rolling back after non-finite steps.

A save waits for the one in flight first (at most one is in flight, and every requested save is
written). A failed save -- a full disk, a vanished directory -- fails on every rank alike and
leaves ``latest`` on the previous checkpoint; ``trainer.on_save_error`` says whether training
continues (``continue``, logged) or stops (``stop``). An asynchronous save's failure surfaces
when the next save starts or the run ends, on every rank at the same step.

A run with low-rank adapters saves its adapters and their optimizer state only
(`bigdense.checkpoint.lora_state`); each save names the frozen base in its manifest (`run_base`:
``model.path`` and the digest of its weight files for ``model=hf``; ``trainer.init_from``'s
checkpoint, or the seed and model config, for the reference GPT), and resuming (or rolling back)
checks that the base the run has now is that one.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..checkpoint import CheckpointError, CheckpointMismatch, load_checkpoint, save_checkpoint
from ..checkpoint._agree import agree, world_rank
from ..checkpoint.format import LATEST, read_manifest, resolve_checkpoint
from ..checkpoint.lora_state import LoRABase, checkpoint_base, hf_base, seed_base
from ..checkpoint.pieces import unwrap
from ..checkpoint.verify import VERIFY_MODES
from ..errors import check_choice, check_positive
from ..layers.lora import has_lora
from .schedule import follow_config
from .faults import BadSteps, TrainingStopped

log = logging.getLogger("bigdense")

SAVE_ERROR_POLICIES = ("continue", "stop")  # trainer.on_save_error


def check_checkpointing(tr) -> None:
    """The ``trainer.*`` keys of checkpoints and faults; errors name the key."""
    check_choice("trainer.on_save_error", tr.on_save_error, SAVE_ERROR_POLICIES)
    check_choice("trainer.checkpoint_verify", tr.checkpoint_verify, VERIFY_MODES)
    check_positive("trainer.max_bad_steps", tr.max_bad_steps, allow_zero=True)
    if tr.keep_last is not None:
        check_positive("trainer.keep_last", tr.keep_last)


def model_changes(checkpoint, cfg) -> str:
    """How the model a run config ``cfg`` builds differs from the one ``checkpoint`` was saved from,
    by its recorded config: ``"model.activation='gelu' in the checkpoint, 'swiglu' here; ..."``
    (the ``model`` group and ``data.vocab_size``); empty when it recorded none or nothing differs."""
    from omegaconf import OmegaConf

    saved = read_manifest(resolve_checkpoint(checkpoint)).get("config")
    if not saved or cfg is None:
        return ""
    here = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    pairs = {f"model.{k}": (saved.get("model", {}).get(k), here["model"].get(k))
             for k in sorted(set(saved.get("model", {})) | set(here["model"]))}
    pairs["data.vocab_size"] = (saved.get("data", {}).get("vocab_size"), here["data"].get("vocab_size"))
    return "; ".join(f"{key}={old!r} in the checkpoint, {new!r} here" for key, (old, new) in pairs.items()
                     if old != new)


def lora_changes(checkpoint, cfg) -> str:
    """How the run config ``cfg``'s adapters (the ``lora`` group) differ from those ``checkpoint``
    was saved with, by its recorded config: ``"lora.r=16 in the checkpoint, 8 here"``; empty when
    it recorded none, or neither trains adapters."""
    from omegaconf import OmegaConf

    saved = (read_manifest(resolve_checkpoint(checkpoint)).get("config") or {}).get("lora")
    here = OmegaConf.to_container(cfg.lora, resolve=True) if cfg is not None and "lora" in cfg else None
    if not saved and not (here and here.get("r")):
        return ""
    saved, here = saved or {"r": 0}, here or {"r": 0}
    keys = ["r"] if not saved.get("r") or not here.get("r") else ["r", "alpha", "targets", "rslora"]  # r=0: none
    return "; ".join(f"lora.{k}={saved.get(k)!r} in the checkpoint, {here.get(k)!r} here" for k in keys
                     if saved.get(k) != here.get(k))


def run_base(cfg) -> LoRABase:
    """The frozen base of a run with adapters: ``model.path`` and the digest of its weight files
    (``model.name=hf``); else ``trainer.init_from``'s checkpoint and the digest of its model
    tensors' records; else ``seed:<trainer.seed>`` and the digest of the seed and the model config."""
    from omegaconf import OmegaConf

    if cfg.model.get("name") == "hf":
        return hf_base(cfg.model.path)
    init_from = cfg.trainer.get("init_from")
    if init_from:
        return checkpoint_base(init_from)
    return seed_base(cfg.trainer.seed, OmegaConf.to_container(cfg.model, resolve=True))


class RunCheckpoints:
    """``checkpoints/step_NNNNNNN`` of one run directory, saved and loaded through ``engine``.

    ``extra`` of every save records the data position (``data_step`` = step + ``data_offset``)
    and the offset itself, which a rollback moves past bad batches. A model with adapters saves
    and loads with its base reference (`base`).
    """

    def __init__(self, directory: Path, engine, trainer_cfg, config=None):
        self.dir, self.engine, self.tr, self.config = Path(directory), engine, trainer_cfg, config
        self.pending = None  # the handle of the save in flight
        self._base: Optional[tuple[Optional[LoRABase]]] = None  # (the base,) once computed

    def base(self) -> Optional[LoRABase]:
        """The run's frozen base (`run_base`) when its model has adapters and the run has a
        config, else None. Computed once, by global rank 0 (it reads the base's weight files
        once per process), and shared with every rank; collective on the first call."""
        if self._base is None:
            model, _ = unwrap(self.engine.checkpoint_state()["model"])
            wanted = self.config is not None and has_lora(model)
            found = agree("the frozen base of the run's adapters",
                          lambda: run_base(self.config) if wanted and world_rank() == 0 else None, gather=True)
            self._base = (found[0],)
        return self._base[0]

    def save(self, step: int, data_offset: int = 0) -> None:
        self.settle()
        try:
            result = save_checkpoint(self.dir / f"step_{step:07d}", **self.engine.checkpoint_state(), step=step,
                                     config=self.config, base=self.base(), extra={"data_step": step + data_offset,
                                                                "data_offset": data_offset},
                                     keep_last=self.tr.keep_last, async_=self.tr.async_save)
        except CheckpointError as err:
            self._failed(err)
            return
        if self.tr.async_save:
            self.pending = result

    def settle(self) -> None:
        """Wait for the save in flight; a failure gets the ``on_save_error`` policy."""
        handle, self.pending = self.pending, None
        if handle is None:
            return
        try:
            handle.wait()
        except CheckpointError as err:
            self._failed(err)

    def _failed(self, err: CheckpointError) -> None:
        if self.tr.on_save_error == "stop":
            raise TrainingStopped(f"checkpoint save failed (trainer.on_save_error=stop): {err}") from err
        log.error("checkpoint save failed; training continues (trainer.on_save_error=continue) and `latest` still "
                  "names the previous checkpoint: %s", err)

    def latest_step(self) -> Optional[int]:
        if not (self.dir / LATEST).exists():
            return None
        return read_manifest(resolve_checkpoint(self.dir / LATEST)).get("step")

    def load_latest(self) -> Optional[tuple[int, int]]:
        """Load ``latest`` into the engine; ``(step, data_offset)``, or ``None`` when there is none."""
        self.settle()
        if not (self.dir / LATEST).exists():
            return None
        try:
            info = load_checkpoint(self.dir / LATEST, **self.engine.checkpoint_state(),
                                   verify=self.tr.checkpoint_verify, base=self.base())
        except CheckpointMismatch as err:
            changes = "; ".join(c for c in (model_changes(self.dir / LATEST, self.config),
                                            lora_changes(self.dir / LATEST, self.config)) if c)
            raise CheckpointMismatch(
                f"cannot resume {self.dir.parent}: its checkpoints are of another model "
                f"({changes or err}). To train this model, start in a new "
                f"trainer.run_dir (or name none: a new directory per launch), or pass trainer.resume=false to "
                f"ignore the checkpoints there") from err
        except CheckpointError as err:  # unreadable (a file corrupted, truncated or missing), or another optimizer's state
            raise CheckpointError(
                f"cannot resume {self.dir.parent}: {err}. To go on, start in a new trainer.run_dir, or pass "
                f"trainer.resume=false to train from step 0 there, ignoring its checkpoints{self._earlier_hint()}"
            ) from err
        if self.config is not None:  # a larger max_steps extends the run over a schedule of the new length
            changes = follow_config(self.engine.scheduler, self.config.optim, self.tr.max_steps)
            if changes:
                log.warning("the learning-rate schedule changed at resume (%s): from step %d it follows the config",
                            "; ".join(changes), info.step + 1)
        return info.step, (info.extra or {}).get("data_offset", 0)

    def _earlier_hint(self) -> str:
        """How to resume from an earlier checkpoint of the run, when it keeps one besides ``latest``."""
        pointer = self.dir / LATEST
        current = pointer.read_text().strip() if pointer.is_file() else ""
        earlier = sorted(p.name for p in self.dir.glob("step_*") if p.is_dir() and p.name != current)
        if not earlier:
            return ""
        return f"; or resume from an earlier checkpoint by writing its name ({earlier[-1]}) into {pointer}"

    def resume(self) -> tuple[int, int]:
        """``(start step, data offset)`` of the run: from ``latest`` when ``trainer.resume`` and there
        is one (logged; a warning when it has nothing left to train), else ``(0, 0)``."""
        resumed = self.load_latest() if self.tr.resume else None
        if resumed is None:
            return 0, 0
        step, latest = resumed[0], self.dir / LATEST
        log.info("resumed from %s at step %d of %d", latest, step, self.tr.max_steps)
        if step >= self.tr.max_steps:
            log.warning("nothing to train: %s is at step %d and trainer.max_steps=%d; extend with a larger "
                        "trainer.max_steps, or start fresh in another trainer.run_dir", latest, step, self.tr.max_steps)
        return resumed

    def rollback(self, bad: BadSteps) -> tuple[int, int]:
        """After too many non-finite steps: load ``latest``; ``(its step, the data offset past the
        bad batches)``, or `TrainingStopped` (see `BadSteps.rollback_offset`)."""
        self.settle()
        offset = bad.rollback_offset(self.latest_step())
        step, _ = self.load_latest()
        return step, offset
