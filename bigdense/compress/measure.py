"""What every compression of `python -m bigdense.compress` measures and reads: the layers it may
compress, their forward time, a weight's squared norm over its shards, the reference GPT of a
checkpoint (built in the structure the checkpoint was compressed to) and its held-out loss."""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch
import torch.nn as nn

from ..layers import ColumnParallelLinear, ParallelClassifierHead, RowParallelLinear
from ..compression.inference import InferenceLinear
from ..compression.sparse import median_ms
from ..parallel import comm

DENSE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def dense_layers(model: nn.Module, patterns) -> list[str]:
    """Names of the compressible layers matching any pattern (heads are not: their loss reads W whole)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, DENSE) and not isinstance(m, ParallelClassifierHead)
            and any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _first_layer(layer: nn.Module) -> nn.Module:
    return layer[0] if isinstance(layer, nn.Sequential) else layer


def _input_width(layer: nn.Module) -> int:
    row = isinstance(layer, RowParallelLinear) or getattr(layer, "kind", None) == "row"
    return layer.partition_size if row and layer.input_is_parallel else layer.in_features


def _reference(layer: nn.Module) -> torch.Tensor:
    """A floating-point tensor of ``layer`` (an int8 or sparse stand-in holds buffers only)."""
    return next(t for t in (*layer.parameters(), *layer.buffers()) if t.is_floating_point())


def forward_ms(layer: nn.Module, tokens: int, repeats: int = 5) -> float:
    """Median forward time of ``layer`` on (tokens, in) inputs, ms (every TP rank runs it together)."""
    first = _reference(layer)
    x = torch.randn(tokens, _input_width(_first_layer(layer)), device=first.device, dtype=first.dtype)
    with torch.no_grad():
        return median_ms(layer, x, repeats)


def is_sharded(layer: nn.Module) -> bool:
    return isinstance(layer, (ColumnParallelLinear, RowParallelLinear, InferenceLinear)) and layer.tp_size > 1


@torch.no_grad()
def summed_over_shards(layer: nn.Module, values: list[torch.Tensor]) -> list[float]:
    """Each of ``values`` (scalars computed on this rank's shard of ``layer``) summed over its TP group."""
    sums = torch.stack([v.double() for v in values])
    if is_sharded(layer):
        comm.all_reduce_(sums, layer.tp_group)
    return sums.tolist()


def squared_norm(layer: nn.Module) -> float:
    """``||W||_F^2`` of the layer's whole weight, from its shards."""
    return summed_over_shards(layer, [layer.weight.detach().double().pow(2).sum()])[0]


def counts(in_f: int, out_f: int, weights_after: int, bias: bool) -> dict:
    """Parameters and FLOPs per token before and after, for ``weights_after`` weights left."""
    return {"params_before": in_f * out_f + bias * out_f, "params_after": weights_after + bias * out_f,
            "flops_per_token_before": 2 * in_f * out_f, "flops_per_token_after": 2 * weights_after}


def held_out_loss(model, cfg, ctx, n_batches: int, run_dp: Optional[int] = None) -> float:
    """Mean held-out loss of the reference GPT on the run's own held-out windows, computed as the
    run computed it (`bigdense.jobs.evaluate.held_out_loss`: eval mode, the run's precision, the
    windows of ``n_batches`` per DP rank of a run with ``run_dp`` DP ranks, by default this mesh's).
    With the checkpoint's own DP size it is the loss the run logged at the checkpoint's step, up to
    the order of the sums."""
    from ..data import prepare_data
    from ..jobs.evaluate import held_out_loss as run_held_out_loss
    from ..train.engines.base import TokenWeights
    from ..train.precision import autocast

    def eval_loss(x, y) -> tuple[float, int]:  # as `Engine.eval_loss_and_tokens`, on the model without an engine
        y = y.to(ctx.device)
        with torch.no_grad(), autocast(cfg.precision.dtype, ctx.device):
            loss = model(x.to(ctx.device), y).detach().float()
        weights = TokenWeights([(x, y)], ctx.dp_group)
        loss = loss * weights.factors[0]
        if ctx.dp_size > 1:
            loss = comm.all_reduce_(loss, ctx.dp_group) / ctx.dp_size
        return float(loss), int(weights.tokens.item())

    data = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed)
    model.eval()
    return run_held_out_loss(eval_loss, data, ctx, n_batches, run_dp)


def apply_compressed_structure(model: nn.Module, compressed: dict) -> None:
    """Give a freshly built GPT the structure a compressed checkpoint's weights need, from the
    checkpoint's ``compressed`` record (low rank and ``d_hidden`` are in its ``model`` config already;
    pruned layers get their masks from the load itself): the int8 layers."""
    from ..compression import quantize_int8

    if compressed.get("int8"):
        quantize_int8(model, layers=list(compressed["int8"]))


def load_reference_gpt(path, ctx):
    """(model, training config, step) of a `launch/train.py` checkpoint, sharded over ``ctx``:
    built (in its compressed structure, for one written by ``python -m bigdense.compress``) and loaded
    through the jobs' `parallelize_model`, for evaluation (no compile, no activation checkpointing,
    no engine)."""
    from omegaconf import OmegaConf

    from ..checkpoint.format import read_manifest, resolve_checkpoint
    from ..jobs import build_gpt, parallelize_model

    manifest = read_manifest(resolve_checkpoint(path))
    if not manifest.get("config"):
        raise ValueError(f"bigdense.compress: {path} records no training config (save it with config=cfg)")
    cfg = OmegaConf.create(manifest["config"])
    vocab = manifest["tensors"]["model/tok_emb.weight"]["global_shape"][0]
    for_evaluation = OmegaConf.merge(cfg, {"trainer": {"compile": False}, "recompute": {"mode": "none"}})
    model = build_gpt(for_evaluation, vocab, ctx)
    apply_compressed_structure(model, OmegaConf.to_container(cfg.get("compressed") or OmegaConf.create({})))
    model = parallelize_model(model, ctx, for_evaluation, init_from=str(path), engine=False).model
    return model, cfg, manifest.get("step")
