"""`ShardedBatchNorm1d`: a BatchNorm over the features a column-parallel layer splits over TP.

``Linear -> BatchNorm1d -> ReLU -> Linear`` (the Linear's bias off) is the classic head block of
VGG-style classifiers. After a column-parallel layer each TP rank holds a slice of the hidden
features, and a BatchNorm is per feature: its batch statistics, its affine weight and bias and its
running statistics of one feature involve that feature only. So each rank normalises its own
features with its slices of ``weight``, ``bias``, ``running_mean`` and ``running_var`` (the
balanced split of the column layer's output, `shard_range`), and no collective over TP is needed:
the result is the plain block's, in train and eval mode, running statistics included.
``num_batches_tracked`` is one counter, replicated. The slices are declared like every bigdense
layer's (`TensorParallelModule._declare_shard`), so checkpoints save and reshard them layout-free
and `to_dense` gives back a plain ``nn.BatchNorm1d``.

``sync_dp=True`` gives ``nn.SyncBatchNorm``'s semantics over data parallelism: in training the batch
statistics are those of every DP replica's rows together (`synced_batch_norm`), which
``nn.SyncBatchNorm`` itself computes on GPUs only. Norms across the features (``nn.LayerNorm``,
``nn.RMSNorm``, ``nn.GroupNorm``) are not per feature and are not handled here:
`per_feature_refusal` says why for each kind, for `bigdense.parallelize`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import check_positive_int
from ..host_checks import checks_enabled
from ..parallel import comm
from ..parallel.context import get_default_context, resolve_tp_group
from ..parallel.sharding import shard_range, shard_sizes
from .base import TensorParallelModule, device_dtype_of

PER_FEATURE_NORMS = (nn.BatchNorm1d, nn.SyncBatchNorm)  # exactly these classes: `ShardedBatchNorm1d` replaces them
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm)
_SHARDED = ("weight", "bias", "running_mean", "running_var")  # per feature; num_batches_tracked is one counter


def per_feature_refusal(module: nn.Module, features: int) -> Optional[str]:
    """Why the norm ``module`` cannot run on a column layer's shard of its ``features`` output
    features (``None``: it can, as a `ShardedBatchNorm1d`)."""
    kind = type(module).__name__
    if type(module) in PER_FEATURE_NORMS:
        if module.num_features != features:
            return f"{kind}(num_features={module.num_features}) does not normalise the {features} features before it"
        return None
    if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm3d, nn.modules.instancenorm._InstanceNorm)):
        return f"{kind} normalises the channels (dim 1) of (N, C, ...) inputs, not the last dim a column layer splits"
    if isinstance(module, nn.modules.batchnorm._NormBase):  # a subclass or a lazy one may compute otherwise
        return f"{kind} is not nn.BatchNorm1d or nn.SyncBatchNorm itself, which alone run on sharded features"
    return (f"{kind} normalises across the features, which a column layer splits over TP (its statistics would "
            f"need an all-reduce over TP: keep it outside a column -> row pair)")


class ShardedBatchNorm1d(TensorParallelModule, nn.BatchNorm1d):
    """``nn.BatchNorm1d(num_features)`` on this rank's balanced slice of the features: input and
    output ``(N, features_local)``, as a `ColumnParallelLinear` (``gather_output=False``) of
    ``num_features`` outputs hands them on. Every option of ``nn.BatchNorm1d`` works as there
    (``momentum=None``: a cumulative average; ``affine=False``; ``bias=False``, which needs a torch
    whose ``nn.BatchNorm1d`` has it; ``track_running_stats=False``).

    ``sync_dp=True``: in training the batch statistics are over every DP replica's rows together
    (``nn.SyncBatchNorm``'s semantics), over ``dp_group`` (default: the parallel context's DP
    group; it must hold no other rank of this rank's TP group). In eval mode each rank uses the
    running statistics (or, without them, its own batch), as ``nn.SyncBatchNorm`` does. Without
    ``sync_dp`` each DP replica normalises with its own batch, as ``nn.BatchNorm1d`` under DDP.
    State-dict names are ``nn.BatchNorm1d``'s; ``isinstance(m, nn.BatchNorm1d)`` holds.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, bias: bool = True, sync_dp: bool = False, dp_group=None,
                 tp_group=None, device=None, dtype=None):
        check_positive_int(f"{type(self).__name__}: num_features", num_features)
        group = resolve_tp_group(tp_group)
        local = shard_sizes(num_features, comm.group_size(group))[comm.group_rank(group)]
        no_bias = {} if bias else {"bias": False}  # an older torch's BatchNorm has no such option
        super().__init__(local, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **no_bias)
        self._setup_tp(group)
        self.num_features, self.num_features_local = num_features, local
        self.partition_start = shard_range(num_features, self.tp_size, self.tp_rank)[0]
        for name in _SHARDED:
            if getattr(self, name) is not None:
                self._declare_shard(name, (num_features,), 0)
        self.sync_dp = bool(sync_dp)
        if dp_group is not None and not self.sync_dp:
            raise ValueError(f"{self._where()}: dp_group is the group sync_dp=True computes statistics over; "
                             f"without sync_dp each rank uses its own batch")
        self.dp_group = self._checked_dp_group(dp_group) if self.sync_dp else None

    def _checked_dp_group(self, dp_group):
        group = get_default_context().dp_group if dp_group is None else dp_group
        if comm.group_size(group) > 1 and self.tp_size > 1:
            peers = set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(self.tp_group))
            if len(peers) > 1:
                raise ValueError(f"{self._where()}: sync_dp's dp_group holds ranks {sorted(peers)} of this rank's TP "
                                 f"group, which normalise other features; pass the DP group (the context's dp_group)")
        return group

    def _describe_shape(self) -> str:
        return f"num_features={self.num_features}"

    def extra_repr(self) -> str:
        sync = f", sync_dp over {comm.group_size(self.dp_group)} replicas" if self.sync_dp else ""
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, features on this rank={self.num_features_local}, "
                f"tp={self.tp_size}{sync}")

    def _check_input_dim(self, x: torch.Tensor) -> None:
        # nn.BatchNorm1d's forward calls this. Over (N, C, L) it would normalise dim 1, which a
        # column layer does not split: only (N, features_local) is this rank's share of the features.
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[-1] != self.num_features_local:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{self._where()}: expected input (N, {self.num_features_local}), this rank's slice of "
                             f"the {self.num_features} features (a column layer's output, not gathered); got {got}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_features_local == 0:  # fewer features than ranks: torch's batch norm cannot run on none
            self._check_input_dim(x)
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)  # the counter stays the same on every rank
            # Through the (empty) weight and bias, so that they get (empty) gradients like every rank's.
            return x * (1.0 if self.weight is None else self.weight) + (0.0 if self.bias is None else self.bias)
        if not (self.training and self.sync_dp and comm.group_size(self.dp_group) > 1):
            return super().forward(x)  # nn.BatchNorm1d's own, on this rank's features: per feature, so exact
        self._check_input_dim(x)
        factor = self.momentum if self.momentum is not None else 0.0
        if self.track_running_stats:  # as nn.BatchNorm1d counts and averages
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return synced_batch_norm(x, self.weight, self.bias, *running, factor, self.eps, self.dp_group)

    # ---- the plain twin (`DenseTwin`): an nn.BatchNorm1d, running statistics and counter included ----
    def _dense_twin(self) -> nn.BatchNorm1d:
        no_bias = {"bias": False} if self.affine and self.bias is None else {}
        return nn.BatchNorm1d(self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats,
                              device="meta", **no_bias)

    @classmethod
    def _check_dense(cls, norm, method: str) -> None:
        if type(norm) not in PER_FEATURE_NORMS:
            is_norm = isinstance(norm, nn.modules.batchnorm._NormBase)
            why = f": {per_feature_refusal(norm, norm.num_features)}" if is_norm else ""
            raise TypeError(f"{cls.__name__}.{method}: expected an nn.BatchNorm1d or nn.SyncBatchNorm, got "
                            f"{type(norm).__name__}{why}")

    @classmethod
    def _empty_from_dense(cls, norm: nn.Module, *, sync_dp: Optional[bool] = None, dp_group=None, tp_group=None):
        """``sync_dp`` defaults to whether ``norm`` is an ``nn.SyncBatchNorm``, whose ``process_group``
        (if set) is the default ``dp_group``."""
        synced = isinstance(norm, nn.SyncBatchNorm) if sync_dp is None else sync_dp
        if synced and dp_group is None and isinstance(norm, nn.SyncBatchNorm):
            dp_group = norm.process_group
        return cls(norm.num_features, norm.eps, norm.momentum, norm.affine, norm.track_running_stats,
                   bias=not norm.affine or norm.bias is not None, sync_dp=synced, dp_group=dp_group,
                   tp_group=tp_group, **device_dtype_of(norm))


class _SyncedBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of ``(N_local, C)`` rows whose statistics are over every rank's rows.

    forward: all-gather over ``group`` of each rank's per-feature (count, mean, sum of squared
    deviations), combined exactly (Chan et al.'s pairwise update: no ``E[x^2] - E[x]^2``
    cancellation); backward: all-reduce (sum) over ``group`` of the per-feature sums of the output
    gradient and of its product with the normalised input, which the input gradient needs. The
    weight and bias gradients are this rank's own sums (a data-parallel engine sums or averages
    them over the replicas, as for any parameter). Statistics are computed in fp32. Fewer than two
    rows in all are refused when host-side checks are on (`bd.set_checks`), as the check reads the
    device.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor, eps, group):
        xf = x.float()
        rows = x.shape[0]
        mean = xf.sum(0) / max(rows, 1)
        mine = torch.cat([xf.new_full((1,), float(rows)), mean, (xf - mean).square().sum(0)]).unsqueeze(0)
        every = comm.all_gather_dim(mine, 0, group, [1] * comm.group_size(group))
        counts, means, squares = every[:, :1], every[:, 1:1 + x.shape[1]], every[:, 1 + x.shape[1]:]
        total = counts.sum()  # a tensor: reading it on the host would wait for the device, so only checks do
        if checks_enabled() and total.item() <= 1:
            raise ValueError(f"synced batch norm: expected more than 1 value per feature over the replicas when "
                             f"training, got {int(total.item())} rows in all")
        mean = (counts * means).sum(0) / total
        var = (squares + counts * (means - mean).square()).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((var * (total / (total - 1))).to(running_var.dtype), alpha=factor)
        y = (xf - mean) * invstd
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd, total = ctx.saved_tensors
        g, xhat = grad.float(), (x.float() - mean) * invstd
        grad_bias, grad_weight = g.sum(0), (g * xhat).sum(0)
        sums = comm.all_reduce_(torch.stack([grad_bias, grad_weight]), ctx.group)  # a copy: the local sums stay
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = scale * (g - sums[0] / total - xhat * (sums[1] / total))
        return (grad_x.to(x.dtype), None if weight is None else grad_weight.to(weight.dtype),
                None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype), None, None, None, None, None)


def synced_batch_norm(x: torch.Tensor, weight, bias, running_mean, running_var, factor: float, eps: float,
                      group) -> torch.Tensor:
    """Training-mode batch norm of ``x`` (N_local, C) with the batch statistics of every rank of
    ``group`` together; updates ``running_mean``/``running_var`` (if given) by ``factor``, with
    the unbiased variance, as ``F.batch_norm`` does. A plain batch norm over a group of one."""
    if comm.group_size(group) == 1:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias, True, factor, eps)
    return _SyncedBatchNorm.apply(x, weight, bias, running_mean, running_var, factor, eps, group)
