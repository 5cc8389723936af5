"""Everything bigdense does because of how DeepSpeed (pinned: 0.19.8) behaves, listed in one place.

The workarounds are defined here, except those of checkpoints (7), which live with the checkpoint
code in `bigdense.checkpoint.ds_state` (this floor imports them from there, never the other way).

Each workaround, the DeepSpeed behaviour it works around, and the test that pins it:

1. `DeepSpeedMPU` -- DeepSpeed learns about tensor parallelism only through an ``mpu`` object with
   Megatron's method names; it sums gradient norms and overflow flags over the model-parallel
   group, counting a gradient on every TP rank only when its parameter carries
   ``tensor_model_parallel``. The sequence-parallel methods are left out on purpose: DeepSpeed
   switches to other group logic when ``initialize_sequence_parallel`` exists.
   Pinned by ``tests/test_engine.py::test_deepspeed_tp2_zero_0_1_2_match_single_process`` and
   ``test_deepspeed_tp2_dp2_zero_0_1_2_match_single_process`` (norms that drop shards are ~25% off).
2. `bigdense_clips` -- at ZeRO stage 0 DeepSpeed's non-ZeRO optimizers compute the clipping norm
   from gradient tensors, which lack ``tensor_model_parallel``, so TP shards on ranks other than 0
   are dropped; bigdense clips with its own `clip_grad_norm_` there. Pinned by the same tests
   (their ZeRO-0 cases).
3. `SkippableAdamW` -- DeepSpeed's fp32 ZeRO-0 path neither reports a norm nor skips a step whose
   gradients are non-finite; its engine does read ``optimizer.overflow`` after ``step()`` to count
   a skipped step and hold the LR schedule, so bigdense's client optimizer honours that attribute.
   Pinned by the same tests (the step with an injected inf must be skipped on every rank).
4. `link_zero_state` -- torch's AdamW creates state at a group's first step, and DeepSpeed links
   parameters to it (what ``safe_get_full_optimizer_state``, and so checkpoints, read) once, right
   after stepping the *first* parameter group, before the others have state: parameters of the
   other groups stay unlinked for good. Pinned by
   ``tests/test_engine.py::test_checkpoint_state_resumes_exactly`` (every parameter of both AdamW
   groups has ZeRO state).
5. `loss_scale` -- the fp16 loss scale sits at ``optimizer.cur_scale`` in some optimizers and at
   ``optimizer.loss_scale_config.cur_scale`` in others. Not pinned by a CPU test: fp16 DeepSpeed
   needs a GPU (its CPU accelerator has no fp16).
6. `initialize` -- ``deepspeed.initialize`` draws from torch's global generator; bigdense's dropout
   masks come from that generator, so building an engine would shift every later mask. It runs
   under ``fork_rng``. Pinned by ``tests/test_train_parity.py`` and the engine parity tests above
   (masks that moved change every loss).
7. `zero_layout`, `zero_fragment`, `loss_scaler_state` (in `bigdense.checkpoint.ds_state`, beside
   the checkpoint code that reads them) -- what checkpoints read from a ZeRO-1/2 or
   BF16 optimizer has no public API: the parameter groups and their flat fp32 partitions sit under
   ``bit16_groups`` / ``single_partition_of_fp32_groups`` (ZeRO) or ``bf16_groups`` /
   ``fp32_groups_flat_partition`` (BF16); where a parameter's fragment lies in this DP rank's
   partition is its ``_hp_mapping`` (``lp_fragment_address`` in the parameter,
   ``get_hp_fragment_address()`` in the partition; ``None`` when the rank holds none of it); the
   fp16 loss scaler's counters are plain attributes of ``loss_scaler`` (``loss_scale_config``
   in the stage-0 optimizer). At stage 0, bf16/fp16 weights get an optimizer whose
   ``fp16_groups`` are the module's parameters and ``fp32_groups`` one master tensor each
   (`unfused_masters`). Pinned by ``tests/test_checkpoint_deepspeed.py`` (ZeRO-1/2 and bf16
   partitions saved per DP rank load bit-exactly at other layouts and into plain AdamW) and
   ``tests/test_engine.py::test_checkpoint_state_resumes_exactly`` (stage 0 bf16 resumes exactly).
8. `initialize` (``world_sharded=``) -- DeepSpeed broadcasts every module parameter from DP rank 0
   when it starts, except MoE experts and parameters marked ``ds_optim_param`` (its
   OptimizedLinear's, unique per rank); a parameter split over the whole mesh has another shape
   on each rank (the broadcast fails) or rank 0's rows. It is marked for the call. Pinned by
   ``tests/test_deepspeed_world.py`` (the start-up broadcasts carry the replicated layer only).
9. `keep_out_of_dp_reduction` -- DeepSpeed's only parameters that are not DP replicas are MoE
   experts, which it averages over an expert DP group (and only when the model holds its MoE
   layers). World-sharded parameters are left out of its optimizer (bigdense steps them:
   `world_sharded.WorldShardedAdamW`), which keeps them out of ZeRO-1/2's reductions; the
   stage-0 all-reduce takes every module parameter that requires a gradient, so they are hidden
   from it. Pinned by ``tests/test_deepspeed_world.py`` (DeepSpeed's collectives move the bytes
   they move for the model with a frozen head, at stages 0-2).
10. `add_to_norm`, `zero_grad_factor` -- ZeRO-1/2 clip inside ``step()`` by a norm over their own
   partitions; the global norm must count the world-sharded gradients (once) and both parts must
   be scaled alike. ``scaled_global_norm`` is wrapped to combine the two, and the world-sharded
   gradients get the factor ``unscale_and_clip_grads`` applied. Pinned by
   ``tests/test_deepspeed_world.py`` (norms equal the DDP engine's `clip_grad_norm_`, clipping
   that bites, weights equal the DDP engine's at ZeRO-1/2, fp32 and bf16; a world-sharded gradient
   inf on one rank skips the step everywhere).
11. `skip_when` -- at stage 0 bigdense clips (workaround 2), but the bf16/fp16 optimizer decides
   to skip by its own overflow check, over its own gradients only; a non-finite world-sharded
   gradient must skip the step too, so its check is OR-ed with bigdense's norm being non-finite.
   Pinned by ``tests/test_deepspeed_world.py`` (the poisoned step, bf16 at stage 0).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...parallel.context import ParallelContext


class DeepSpeedMPU:
    """bigdense's TP x DP mesh in the shape of DeepSpeed's model-parallel unit (``mpu=``).

    DeepSpeed asks it for the model-parallel group (to sum gradient norms and overflow flags across
    tensor shards) and for the data-parallel group (ZeRO partitions optimizer state and gradients
    over it, and averages gradients over it). bigdense has no pipeline stages, so "model parallel"
    is TP exactly. Only the methods DeepSpeed calls are provided (see workaround 1 above).
    """

    def __init__(self, ctx: ParallelContext):
        if not ctx.is_distributed or ctx.tp_group is None or ctx.dp_group is None:
            raise ValueError(
                "DeepSpeedMPU: the parallel context has no process groups (a single process without a launcher); "
                "engine.kind=deepspeed needs torch.distributed -- launch with torchrun or deepspeed, "
                "even for one process"
            )
        self.ctx = ctx

    # model parallel == tensor parallel (no pipeline)
    def get_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size

    def get_model_parallel_group(self):
        return self.ctx.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ctx.tp_size

    def get_tensor_model_parallel_group(self):
        return self.ctx.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this rank's TP group (the mesh puts TP innermost)."""
        return self.ctx.dp_rank * self.ctx.tp_size

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_size

    def get_data_parallel_group(self):
        return self.ctx.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return [d * self.ctx.tp_size + self.ctx.tp_rank for d in range(self.ctx.dp_size)]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def bigdense_clips(zero_stage: int) -> bool:
    """Whether bigdense clips (and, in fp32, skips) itself rather than DeepSpeed (workaround 2):
    at stage 0, on the DP-averaged gradients after DeepSpeed's backward, before its step."""
    return zero_stage == 0


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW honouring DeepSpeed's ``optimizer.overflow`` protocol (workaround 3): set
    ``overflow`` before DeepSpeed's ``step()`` and the step is skipped and counted as skipped."""

    overflow = False

    def step(self, closure=None):
        if self.overflow:
            return None
        return super().step(closure)


def link_zero_state(optimizer) -> None:
    """Give each ZeRO flat partition its AdamW state now and link every parameter to its slice
    (workaround 4). Zero state with step 0 is exactly what AdamW would create; with it in place
    every group links, now and at DeepSpeed's own lazy link. Other DeepSpeed optimizers are left alone.
    """
    lp_groups = getattr(optimizer, "bit16_groups", None)
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None)
    inner = getattr(optimizer, "optimizer", None)
    if lp_groups is None or flats is None or not isinstance(inner, torch.optim.Optimizer):
        return
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's choice
    for lps, flat in zip(lp_groups, flats):
        state = inner.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=step_dtype)
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        lazy_init_hp_params_optimizer_state(lps, flat, inner.state)


def loss_scale(optimizer) -> float:
    """The current fp16 loss scale of a DeepSpeed optimizer, wherever it keeps it (workaround 5)."""
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(optimizer, "loss_scale_config", None), "cur_scale", 1.0)
    return float(scale)


def initialize(ctx: ParallelContext, world_sharded: Sequence[torch.Tensor] = (), **kwargs):
    """``deepspeed.initialize(**kwargs)`` without moving torch's generators (workaround 6), and
    without broadcasting the ``world_sharded`` parameters over DP (workaround 8)."""
    import deepspeed

    rng_devices = [ctx.device] if ctx.device.type == "cuda" else []
    for p in world_sharded:
        p.ds_optim_param = True  # what DeepSpeed's start-up broadcast skips: "unique per rank"
    try:
        with torch.random.fork_rng(devices=rng_devices):
            return deepspeed.initialize(**kwargs)
    finally:
        for p in world_sharded:
            del p.ds_optim_param


def keep_out_of_dp_reduction(engine, params: Sequence[torch.Tensor]) -> None:
    """DeepSpeed's stage-0 all-reduce (fp32, and bf16/fp16 without ZeRO) takes every module
    parameter that requires a gradient, creating zero gradients for missing ones: ``params`` are
    hidden from it (``requires_grad`` off for the call), so it carries nothing for them
    (workaround 9)."""
    reduce = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            return reduce(*args, **kwargs)
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)

    engine.allreduce_gradients = allreduce_gradients


def skip_when(optimizer, nonfinite: Callable[[], bool]) -> None:
    """Make a stage-0 bf16/fp16 optimizer skip its step when ``nonfinite()`` (bigdense's global
    norm, world-sharded gradients included, is inf or nan), as it does for an overflow in its own
    gradients: its overflow check is OR-ed with it (workaround 11)."""
    checker = optimizer.overflow_checker
    check = checker.check

    def check_both(*args, **kwargs):
        return bool(check(*args, **kwargs)) or nonfinite()

    checker.check = check_both


def is_zero(optimizer) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer (it clips inside its step)."""
    return hasattr(optimizer, "scaled_global_norm") and hasattr(optimizer, "bit16_groups")


def add_to_norm(optimizer, world_norm: Callable[[], torch.Tensor]) -> None:
    """Make the norm ZeRO-1/2 clips (and skips) by the global one: its ``scaled_global_norm``
    (over its own partitions) combined with ``world_norm()``, the norm of the gradients it does not
    hold, in the same loss-scaled units (workaround 10). The factor it then applied to its own
    gradients is `zero_grad_factor`'s."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    if not is_zero(optimizer):
        raise TypeError(f"add_to_norm: {type(optimizer).__name__} is not DeepSpeed's ZeRO-1/2 optimizer")
    own_norm = optimizer.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        own = own_norm(norm_type)
        own = own if torch.is_tensor(own) else torch.tensor(float(own))
        return combine_grad_norm_groups([own.float(), world_norm().to(own.device)], norm_type=norm_type)

    optimizer.scaled_global_norm = scaled_global_norm


def zero_grad_factor(optimizer, grad_clip: float, scale_before: float) -> float:
    """What ZeRO-1/2's step just multiplied its gradients by (``unscale_and_clip_grads``: the loss
    scale and the clip coefficient of the combined norm), for the gradients it does not hold
    (workaround 10)."""
    scale = loss_scale(optimizer)  # DeepSpeed unscales by the scale as updated in its step
    combined = scale
    if grad_clip > 0:
        total = float(optimizer._global_grad_norm) * scale_before / scale
        combined = max((total + 1e-6) / grad_clip, 1.0) * scale
    return 1.0 / combined
