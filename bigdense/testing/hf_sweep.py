"""Every Hugging Face causal-LM architecture with a tensor-parallel plan, converted by its own plan
and checked against the unconverted model: the sweep behind docs/converting-models.md.

    .venv/bin/python -m bigdense.testing.hf_sweep --tp 2                # every architecture, a table
    .venv/bin/python -m bigdense.testing.hf_sweep --tp 3 --only llama,qwen3_moe --json out.jsonl

For each architecture (`bigdense.testing.hf_models`: a tiny model from its default config, and the
variant that switches on the rest of its plan where there is one), on ``tp`` CPU gloo ranks:
`compare_on_this_rank` (logits and loss before and after one SGD step, every gradient), then a
checkpoint saved sharded, exported (`bd.export_dense`) and loaded into the plain model, whose every
tensor must equal the converted model's shards bit for bit. Each architecture ends as

* ``exact``: every comparison within fp32 round-off (`bigdense.testing.check`) and the export exact;
  what the conversion kept whole, and why, is listed; so is the loss path of `bigdense.models.CausalLM`
  around the converted model (``fused``, with the logit transform found, or ``gathered`` and why),
  whose loss and every gradient are compared with the plain model's logits and ``F.cross_entropy``
  (`bigdense.testing.check.compare_fused_loss`);
* ``refused``: `bd.parallelize` refused it, with its message;
* ``differs`` / ``error``: a bug (none is expected; the test fails on them);
* ``unbuildable``: its tiny model cannot be built or run here (a missing optional dependency, a
  drafter that needs its target model), before bigdense is involved.

It runs against whatever transformers is installed (the architectures are those it ships), and its
table's first line and every JSON line name that version (`versions`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..parallelize.hf import transformers_version
from .check import beyond, compare_fused_loss, compare_pair, converted_pair, merge
from .ranks import RankError, run_ranks

RTOL = 1e-4


def versions() -> dict[str, str]:
    """What a sweep's results depend on beside bigdense: the installed transformers and torch."""
    return {"transformers": transformers_version(), "torch": torch.__version__}


@dataclass
class ArchResult:
    name: str  # model_type, "+variant" for its variant layout
    status: str  # exact | refused | differs | error | unbuildable
    detail: str = ""
    sharded_fraction: Optional[float] = None
    kept_whole: Optional[dict] = None  # {module pattern: why} beyond "not named by the plan"
    not_in_plan: int = 0  # dense layer patterns the model's own plan does not name
    worst_output: Optional[float] = None  # relative
    worst_grad: Optional[float] = None
    loss_path: str = ""  # `CausalLM.loss_path`, described
    worst_loss: Optional[float] = None  # the CausalLM's loss and gradients against the plain logits path, relative


def architectures(only: Optional[list[str]] = None) -> list[tuple[str, bool]]:
    """``(model_type, variant)`` of every planned architecture (and variant), or of ``only``."""
    from .hf_models import VARIANTS, planned_causal_lm_types

    types = planned_causal_lm_types()
    if only:
        types = [t for t in types if t in only]
    return [(t, False) for t in types] + [(t, True) for t in types if t in VARIANTS]


def _buildable(model_type: str, variant: bool, overrides: dict) -> Optional[str]:
    """None when the tiny model builds and runs forward here, else why not (checked before any
    collective, on every rank alike)."""
    from .hf_models import build_tiny, token_batch

    try:
        torch.manual_seed(0)
        model = build_tiny(model_type, variant, **overrides)
        with torch.no_grad():
            model(**token_batch())
        return None
    except Exception as err:  # noqa: BLE001 - any failure of transformers' own code on its default config
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        return f"{type(err).__name__}: {first[:200]}"


def _export_is_exact(model, model_type: str, variant: bool, overrides: dict, directory: Path) -> Optional[str]:
    """Save the converted model sharded, export it, load the export into the plain model: None when
    every tensor equals the converted model's shards, else what differs."""
    from safetensors.torch import load_model

    from ..checkpoint import export_dense, save_checkpoint
    from ..layers.base import named_shard_specs
    from .hf_models import build_tiny

    save_checkpoint(directory / "ckpt", model, step=1)
    if dist.get_rank() == 0:
        export_dense(directory / "ckpt", directory / "model.safetensors")
    dist.barrier()
    plain = build_tiny(model_type, variant, **overrides)
    load_model(plain, str(directory / "model.safetensors"), strict=True)
    specs, exported = named_shard_specs(model), dict(plain.named_parameters())
    for name, p in model.named_parameters():
        spec = specs.get(name)
        want = spec.slice_of(exported[name].detach()) if spec is not None else exported[name].detach()
        if not torch.equal(p.detach(), want):
            return f"the exported {name} is not the converted model's"
    return None


def _one(model_type: str, variant: bool, overrides: dict, workdir: Path) -> dict:
    from .hf_models import build_tiny, token_batch

    name = model_type + ("+variant" if variant else "")
    why_not = _buildable(model_type, variant, overrides)
    if why_not is not None:
        return asdict(ArchResult(name, "unbuildable", why_not))
    try:
        reference, model = converted_pair(lambda: build_tiny(model_type, variant, **overrides))
    except (ValueError, TypeError) as err:  # bd.parallelize's refusals
        if "parallelize" not in str(err):
            raise
        return asdict(ArchResult(name, "refused", str(err).splitlines()[0]))
    report = model.bd_parallel_report
    result = asdict(ArchResult(
        name, "exact", sharded_fraction=report.sharded_fraction,
        kept_whole={k: v for k, v in report.dense.items() if v != "not named by the plan"},
        not_in_plan=sum(v == "not named by the plan" for v in report.dense.values())))
    result["comparison"] = compare_pair(reference, model, token_batch(), steps=1)
    result["loss_path"], result["loss_diffs"] = _loss_path(reference, model)
    wrong = _export_is_exact(model, model_type, variant, overrides, workdir / name)
    if wrong:
        result.update(status="differs", detail=wrong)
    return result


def _loss_path(reference, model) -> tuple[str, dict]:
    """The converted model's loss path in a `CausalLM`, and its loss and gradients against the
    plain model's logits path on a batch with ignored targets."""
    from ..models import CausalLM
    from .hf_models import token_batch

    causal = CausalLM(model)
    path = causal.prepare_loss()
    ids = token_batch()["input_ids"]
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    targets[0, :3] = -100
    return path.describe(), compare_fused_loss(reference, causal, ids, targets)


def _on_this_rank(model_type: str, variant: bool, tp: int, workdir: str, overrides: dict) -> dict:
    from ..parallel.context import init_parallel

    init_parallel(tp=tp)
    logging.getLogger("bigdense.parallelize").setLevel(logging.ERROR)  # the summary is in the result
    return _one(model_type, variant, overrides, Path(workdir))


def sweep(tp: int, only: Optional[list[str]] = None, timeout: float = 300.0, **overrides) -> list[ArchResult]:
    """Every architecture (or ``only`` those) at TP size ``tp`` (see the module docstring), each on
    ranks of its own (one that fails cannot hold up the next); ``overrides`` change every tiny
    config (``num_key_value_heads=4``)."""
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for model_type, variant in architectures(only):
            try:
                rows = run_ranks(_on_this_rank, tp, model_type, variant, tp, workdir, overrides, timeout=timeout)
            except RankError as err:
                name = model_type + ("+variant" if variant else "")
                results.append(ArchResult(name, "error", str(err).strip().splitlines()[-1][:300]))
                continue
            results.append(_merged(rows, tp))
    return results


def _merged(rows: list[dict], tp: int) -> ArchResult:
    """One architecture's result over its ranks: differs if any rank's comparison does."""
    row = dict(rows[0])
    comparisons = [r.pop("comparison", None) for r in rows]
    loss_diffs = [r.pop("loss_diffs", None) or {} for r in rows]
    row.pop("comparison", None), row.pop("loss_diffs", None)
    if row["status"] == "exact":
        check = merge(tp, comparisons, RTOL)
        row["worst_output"], row["worst_grad"] = _worst(check.outputs), _worst(check.grads)
        every = {k: (max(d[k][0] for d in loss_diffs), max(d[k][1] for d in loss_diffs)) for k in loss_diffs[0]}
        row["worst_loss"] = _worst(every)
        if not check.exact:
            row.update(status="differs", detail=check.describe().replace("\n", " "))
        elif beyond(every, RTOL):
            bad = ", ".join(sorted(beyond(every, RTOL))[:3])
            row.update(status="differs", detail=f"the CausalLM's loss path ({row['loss_path']}) differs from the plain "
                                                f"logits path in {bad}")
    return ArchResult(**row)


def _worst(diffs: dict) -> float:
    return max((d / max(s, 1e-12) for d, s in diffs.values()), default=0.0)


def markdown(results: list[ArchResult], tp: int) -> str:
    """The per-architecture table of the docs."""
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "differs", "error", "unbuildable")}
    on = ", ".join(f"{k} {v}" for k, v in versions().items())
    lines = [f"tp={tp} ({on}): {len(results)} architectures and variants; "
             + ", ".join(f"{n} {s}" for s, n in counts.items()),
             f"loss path: {sum(r.loss_path.startswith('fused') for r in results)} fused, "
             f"{sum(r.loss_path.startswith('gathered') for r in results)} gathered",
             "", "| architecture | result | split over TP | loss path | kept whole (why) |", "|---|---|---|---|---|"]
    for r in results:
        share = f"{r.sharded_fraction:.0%}" if r.sharded_fraction is not None else ""
        by_reason: dict[str, list[str]] = {}
        for pattern, why in (r.kept_whole or {}).items():
            by_reason.setdefault(why, []).append(f"`{pattern.rpartition('.')[2] or pattern}`")
        kept = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items()) or r.detail
        if r.not_in_plan:
            kept = (kept + "; " if kept else "") + f"{r.not_in_plan} dense layer patterns its plan does not name"
        lines.append(f"| {r.name} | {r.status} | {share} | {r.loss_path} | {kept} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bigdense.testing.hf_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    parser.add_argument("--heads", type=int, nargs=2, metavar=("HEADS", "KV_HEADS"),
                        help="attention and key/value heads of every tiny model (default 4 and 2)")
    args = parser.parse_args(argv)
    overrides = dict(num_attention_heads=args.heads[0], num_key_value_heads=args.heads[1]) if args.heads else {}
    results = sweep(args.tp, args.only.split(",") if args.only else None, **overrides)
    print(markdown(results, args.tp))
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps({"tp": args.tp, **versions(), **asdict(r)}) + "\n")
    return 0 if all(r.status in ("exact", "refused", "unbuildable") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
