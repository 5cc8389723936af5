"""A classifier head over very many classes, sharded by class over TP (or every rank), whose loss
never holds the logits.

    head = bd.ParallelClassifierHead(1024, num_classes=1_000_000, bias=False)
    loss = head.loss(h, target, label_smoothing=0.1)     # == F.cross_entropy(full logits, target, ...)
    scores, classes = head.predict(h, k=5)              # global top-5; full logits never gathered
    face = bd.ParallelClassifierHead(512, 3_000_000, bias=False, shard="world", sample_rate=0.1,
                                     margin="arcface")  # Partial FC: InsightFace's recipe

The head is a `ColumnParallelLinear` over classes (so ``from_dense``/``to_dense``/``load_dense_``
with an ``nn.Linear`` as its plain twin, TP-invariant init and shard specs come with it); ``loss``
and ``predict`` work chunk by chunk over tokens so the per-rank logits working set is (chunk,
classes_local), never (tokens, classes_local).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from ...parallel import comm
from ...parallel.autocast import autocast_dtype
from ...parallel.regions import copy_to_tp, gather_from_sequence
from ...errors import check_positive_int, is_positive_int
from ...kernels.softmax_ce import softcapped
from .modes import ClassGroups, DPBlocks, check_target, loss_inputs, resolve_class_groups
from ..init import InitSpec, init_bias_
from ..linear import ColumnParallelLinear
from .margin import MarginSpec, resolve_margin
from .sampling import check_sample_rate
from .fused_ce import STRATEGIES, auto_chunk_size, check_logit_options, fused_cross_entropy


class ParallelClassifierHead(ColumnParallelLinear):
    """``logits = h W^T + b`` over ``num_classes`` classes, split by class over TP (uneven allowed).

    Per rank: ``weight`` (classes_local, in_features) and ``bias`` (classes_local,) hold classes
    ``[class_start, class_start + classes_local)`` of the balanced split; both are declared sharded
    (dim 0). ``classes_local`` may be 0 when ``num_classes < tp``: that rank then holds no class and
    everything still works. Inputs ``h`` (*, in_features) and ``target`` (*) are the same on every
    TP rank.

    ``chunk_size``: tokens per chunk in ``loss`` and ``predict``. ``None`` picks the largest chunk
    whose logits on the rank with the most classes (scored classes, when sampling) fit the loop's
    budget: on CPU (and for fp16) fp32 logits in one buffer of ``ce_chunks.AUTO_CHUNK_BYTES`` (128
    MiB on CPU, at least 64 tokens; 512 MiB on GPUs; `bigdense.layers.head.ce_chunks.auto_chunk_size`),
    on GPUs in bf16/fp32 ``ce_gpu.KERNEL_LOGITS_BYTES`` of logits in the matmul dtype
    (`bigdense.layers.head.ce_gpu.kernel_chunk_tokens`).
    ``fp32_weight_grad``: on the GPU loop, accumulate the weight's gradient in fp32 even for bf16
    weights (twice its memory; docs/heads.md gives the accuracy of both); elsewhere it always is.
    ``grad_strategy``: ``"forward"`` (form the gradients while the forward has each chunk's logits:
    3 matmuls) or ``"recompute"`` (recompute the logits in the backward: 4 matmuls, lets you call
    backward twice); see `bigdense.layers.head.fused_ce` for the measurements behind the default.
    ``init`` defaults to nn.Linear's ("torch"), with nn.Linear's bias law.

    ``forward(h)`` is ``logits(h)``: this rank's shard of the logits, (*, classes_local).
    Tie the weight to a `VocabParallelEmbedding` with `tie_weights`. It takes no low-rank adapter
    (``lora_kind``: its loss is fused, there is no output to add one to; PEFT leaves the head too).

    ``sequence_parallel=True``: ``h`` is (*, S_local, in_features), this rank's balanced share of
    the sequence, and ``target`` (*, S) replicated. The hidden states are all-gathered along the
    sequence (never the logits); the gradient of ``h`` is then reduce-scattered instead of
    all-reduced.

    ``shard``: ``"tp"`` splits the classes over the TP group; ``"world"`` over every rank of the
    TP x DP mesh (rank ``dp_rank * tp + tp_rank`` holds the shard of that index), as Partial FC
    does: ``loss`` and ``predict`` all-gather the DP ranks' tokens (their gradients are
    reduce-scattered back), so the weight, its gradient and its optimizer state exist once in the
    job and data parallelism must leave them alone (the engines do: the shard spec says
    ``group="world"``). Each rank's ``loss`` is still the mean over its own tokens and the weight's
    gradient the DP average, so it is a drop-in for the TP-sharded head under DDP. Without a DP
    group of more than one rank it runs as ``"tp"`` (with a warning). ``dp_group`` defaults to the
    default context's.

    ``sample_rate`` r in (0, 1]: each ``loss`` scores the classes that are targets somewhere in the
    global batch plus each other class with probability r (`bigdense.layers.head.sampling`: a function
    of a seed drawn from torch's default generator at each call, the global batch's targets and the
    class index, so the same at every layout). The softmax runs over those classes only (label
    smoothing too); r = 1 is the exact full loss. Unsampled rows get a zero gradient: plain SGD
    leaves them alone; Adam keeps moving them by their decaying moments (and weight decay), which is
    what Partial FC's current version does with one indexed weight. ``predict`` always scores every
    class.

    ``margin``: ``None``, ``"arcface"`` = ``(1, 0.5, 0)``, ``"cosface"`` = ``(1, 0, 0.35)`` or
    ``(m1, m2, m3)``; the logits become ``scale * cos`` of L2-normalised features and class vectors,
    the target's ``scale * (cos(m1 theta + m2) - m3)`` (`bigdense.layers.head.margin`), inside the fused
    chunked loss. Needs ``bias=False``. ``logits`` and ``predict`` then give ``scale * cos``, so
    ``predict`` ranks by cosine. ``scale`` is InsightFace's 64 by default; far above what the class
    count needs (AdaCos's ``sqrt(2) ln(C - 1)``: 14 for 20,000 classes) it puts the softmax on the
    few hardest negatives and slows early training (docs/performance.md, the accuracy suite).

    ``softcap`` c (None or 0: off): the logits are ``c * tanh(z / c)`` (Gemma 2's
    ``final_logit_softcapping``) in ``loss``, ``logits`` and ``predict``; the loss's gradient goes
    through the tanh exactly, inside the fused loop. Not with a margin. ``z_loss`` (0: off): each
    counted token's loss gains ``z_loss * lse**2`` (PaLM's auxiliary loss, keeping the softmax's
    normaliser near 1), reduced as the loss is; the collector of `bigdense.layers.head.metrics`
    gets it apart, with the tokens predicted right. Both are also options of each ``loss`` call.
    """

    lora_kind = None

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        shard: str = "tp",
        sample_rate: float = 1.0,
        margin: MarginSpec = None,
        scale: float = 64.0,
        chunk_size: Optional[int] = None,
        grad_strategy: str = "forward",
        fp32_weight_grad: bool = False,
        softcap: Optional[float] = None,
        z_loss: float = 0.0,
        sequence_parallel: bool = False,
        init: InitSpec = "torch",
        tp_group=None,
        dp_group=None,
        device=None,
        dtype=None,
    ):
        where = f"ParallelClassifierHead(in_features={in_features}, num_classes={num_classes})"
        sample_rate = check_sample_rate(sample_rate, where)
        self_margin = resolve_margin(margin, scale, where)
        if self_margin is not None and bias:
            raise ValueError(f"{where}: margin={margin!r} normalises the class vectors, so the head has no bias; "
                             "pass bias=False")
        softcap, z_loss = check_logit_options(f"{where}: ", softcap, z_loss)
        if self_margin is not None and softcap:
            raise ValueError(f"{where}: margin={margin!r} sets the logits to scale * cos, which a softcap would bend; "
                             "pass softcap=None with a margin")
        groups = resolve_class_groups(shard, tp_group, dp_group, where)
        if groups.shard == "world" and sequence_parallel:
            raise ValueError(f"{where}: shard='world' gathers every DP rank's tokens; it does not combine with "
                             "sequence_parallel=True (use shard='tp')")
        check_positive_int("ParallelClassifierHead: num_classes", num_classes)
        if chunk_size is not None and not is_positive_int(chunk_size):
            raise ValueError(
                f"ParallelClassifierHead: chunk_size must be a positive integer or None, got {chunk_size!r}"
            )
        if grad_strategy not in STRATEGIES:
            raise ValueError(
                f"ParallelClassifierHead: grad_strategy must be one of {STRATEGIES}, got {grad_strategy!r}"
            )
        # The classes are split over `groups.classes` (the TP group, or the whole mesh): the
        # layer's "TP group" below is that group, so init, shard specs and dense conversion follow it.
        self.groups: ClassGroups = groups  # (before the parameters: `shard_spec` reads it)
        super().__init__(
            in_features, num_classes, bias, gather_output=False, sequence_parallel=sequence_parallel, init=init,
            tp_group=groups.classes, device=device, dtype=dtype,
        )
        self._tied_embedding = None  # (embedding,) once `tie_weights` ran
        self._dp_blocks = DPBlocks()  # how DP ranks' tokens are gathered (world sharding, sampling)
        self.chunk_size = chunk_size
        self.grad_strategy = grad_strategy
        self.fp32_weight_grad = bool(fp32_weight_grad)
        self.sample_rate = float(sample_rate)
        self.margin = self_margin
        self.softcap, self.z_loss = softcap, z_loss

    @property
    def shard(self) -> str:
        return self.groups.shard

    def shard_spec(self, name: str):
        spec = super().shard_spec(name)
        return spec if spec is None or self.shard == "tp" else dataclasses.replace(spec, group="world")

    @property
    def num_classes(self) -> int:
        return self.out_features

    @property
    def class_start(self) -> int:
        return self.partition_start

    @property
    def classes_local(self) -> int:
        return self.partition_size

    def _describe_shape(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}"

    def extra_repr(self) -> str:
        tied = ", weight tied to an embedding" if self._tied_embedding is not None else ""
        return (
            f"{self._describe_shape()}, bias={self.bias is not None}, classes on this rank="
            f"{self.classes_local} (from {self.class_start}), shard={self.shard!r} over {self.tp_size} ranks, "
            f"sample_rate={self.sample_rate}, margin={self.margin}, softcap={self.softcap or None}, "
            f"z_loss={self.z_loss}, chunk_size={self.chunk_size}{tied}"
        )

    # ---- the plain twin (`DenseTwin`, through `ColumnParallelLinear`) ----
    @classmethod
    def _empty_from_dense(cls, linear, **options):
        if options.get("margin") is not None and linear.bias is not None:
            raise ValueError(f"{cls.__name__}.from_dense: margin={options['margin']!r} normalises the class vectors, "
                             f"so the head has no bias; got an nn.Linear with a bias")
        return super()._empty_from_dense(linear, **options)

    def to_dense(self):
        """``nn.Linear(in_features, num_classes, bias=...)`` with every class's weight (and bias), on
        every rank: a collective over the ranks the classes are split over (the TP group, or every
        rank with ``shard="world"``). Its forward is the full logits ``h W^T + b``. What the head adds
        is not in it, as none of it is a weight: the loss's chunking and gradient strategy, the
        class sampling (a loss option), the margin and its ``scale`` (``logits`` here are then
        ``scale * cos``; the twin's are the plain product), the sharding and the tie to an
        embedding (the twin holds a copy). ``from_dense(twin, margin=..., shard=...)`` puts them back."""
        return super().to_dense()

    def reset_parameters(self) -> None:
        if getattr(self, "_tied_embedding", None) is None:  # (the constructor calls this before setting it)
            return super().reset_parameters()
        # Tied: the embedding owns (and initialises) the weight. `to_empty` (meta materialisation)
        # replaces Parameters and so unties them; tie again to the embedding's current weight.
        self.weight = self._tied_embedding[0].weight
        if self.bias is not None:
            with torch.no_grad():
                init_bias_(
                    self.bias, self.init, self.in_features, self.out_features, self.class_start, self._weight_seed
                )

    def _chunk(self) -> int:
        # From the largest shard, so every rank cuts the tokens at the same places (one collective per chunk).
        return self.chunk_size or auto_chunk_size(max(self.partition_sizes), self.weight.device.type)

    def logits(self, h: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        """This rank's shard of the logits of ``h`` as given (no DP gathering), (*, classes_local);
        with a margin, ``scale * cos``; with a softcap, capped. Grad of ``h`` is summed over TP."""
        if self.margin is None:
            return softcapped(super().forward(h, seq_len), self.softcap)
        if self.sequence_parallel:  # the gather's backward reduce-scatters the partial gradient
            h = self._gather_sequence(h, seq_len)
        else:
            self._check_input(h, self.in_features, "in_features", self.weight)
            h = copy_to_tp(h, self.tp_group)
        return F.linear(F.normalize(h, dim=-1) * self.margin.scale, F.normalize(self.weight, dim=-1))

    def _gather_sequence(self, h: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Under sequence parallelism, the whole sequence of hidden states on every rank."""
        self._check_input(h, self.in_features, "in_features, this rank's share of the sequence", self.weight)
        return gather_from_sequence(h, self.tp_group, self._sequence_shares(h, seq_len))

    def forward(self, h: torch.Tensor, target: Optional[torch.Tensor] = None, **loss_options) -> torch.Tensor:
        """``logits(h)``; with ``target``, ``loss(h, target, **loss_options)`` (so hooks see the head)."""
        return self.logits(h) if target is None else self.loss(h, target, **loss_options)

    # ---- loss ----
    def loss(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: Optional[float] = None,
        z_loss: Optional[float] = None,
    ) -> torch.Tensor:
        """``F.cross_entropy(full_logits, target, ...)`` computed vocab-parallel, fused and chunked.

        ``h`` (*, in_features), ``target`` (*) integer class ids (or ``ignore_index``), both
        replicated on TP. Returns an fp32 scalar (``"mean"``, ``"sum"``) or ``target``'s shape
        (``"none"``), the same on every rank; gradients flow to ``h`` (summed over TP), ``weight``
        and ``bias``. The softmax is accumulated in fp32; under autocast the matmuls run in
        autocast's dtype, as ``F.linear`` would. ``softcap`` and ``z_loss``: None takes the head's
        (see the class docstring), 0 turns them off for this call; the z-loss is part of the result.

        Edges, identical on every rank: a label outside ``[0, num_classes)`` that is not
        ``ignore_index`` raises ValueError naming it (a host-side check, behind `bd.set_checks`;
        with checks off nothing leaves the device and such a token's loss and gradients are NaN,
        so the step's loss and gradient norm are NaN and the training loop skips the step); an
        empty batch works; when every token is ignored, ``"mean"`` gives 0 with zero gradients,
        where F.cross_entropy gives nan (deliberate: one padded-out batch must not poison a run).
        The number of counted tokens stays a tensor: the loss makes no host synchronisation with
        checks off.

        With ``sample_rate < 1`` the softmax (and label smoothing) runs over the sampled classes;
        with a margin the logits are the margin head's (see the class docstring); world-sharded,
        ``h`` and ``target`` are this DP rank's and the loss is over them alone.
        """
        if self.sequence_parallel:
            if not isinstance(target, torch.Tensor) or target.dim() == 0:
                raise ValueError(f"{self._where()}: sequence_parallel=True expects target (*, S), got {target!r}")
            h = self._gather_sequence(h, target.shape[-1])
        self._check_input(h, self.in_features, "in_features, replicated on every TP rank", self.weight)
        check_target(self._where(), h, target, ignore_index, self.num_classes)
        softcap = self.softcap if softcap is None else softcap
        if softcap and self.margin is not None:
            raise ValueError(f"{self._where()}: softcap={softcap} does not combine with the head's margin")
        x = loss_inputs(self, h.reshape(-1, self.in_features), target.reshape(-1), int(ignore_index))
        out = fused_cross_entropy(
            x.h, x.classes.weight, x.classes.bias, x.classes.target, where=self._where(),
            group=self.tp_group, num_classes=x.classes.num_classes, class_start=x.classes.class_start,
            largest_shard=x.classes.largest_shard, label_smoothing=label_smoothing, ignore_index=x.classes.ignore_index,
            reduction=reduction, softcap=softcap, z_loss=self.z_loss if z_loss is None else z_loss,
            chunk_size=self.chunk_size, strategy=self.grad_strategy, fp32_weight_grad=self.fp32_weight_grad,
            # Under sequence parallelism the gather's backward reduce-scatters the partial gradient.
            sum_grad_h=not self.sequence_parallel, target_offset=x.target_offset, rows=x.rows,
            sample=x.classes.sample, grad_group=self.groups.tp if x.rows is not None else None,
        )
        return out.view(target.shape) if reduction == "none" else out

    # ---- prediction ----
    @torch.no_grad()
    def predict(self, h: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Global top-``k`` logits and class ids, (*, k) each, the same on every rank.

        Each rank takes its own top-k per chunk of tokens, every rank gathers the ``k * tp``
        candidates (never the logits) and keeps the best ``k``. Ties go to the lower class id,
        deterministically (NaN logits rank as -inf). Under sequence parallelism ``h`` is this
        rank's share of the sequence and the result covers the whole sequence. A margin head ranks
        by ``scale * cos``; a world-sharded head gathers the DP ranks' tokens and returns this rank's
        rows.
        """
        if self.sequence_parallel:
            h = self._gather_sequence(h, None)
        self._check_input(h, self.in_features, "in_features, replicated on every TP rank", self.weight)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_classes:
            raise ValueError(f"{self._where()}: k must be an integer in [1, {self.num_classes}], got {k!r}")
        flat, weight = h.reshape(-1, self.in_features), self.weight
        own = slice(None)
        if self.shard == "world":
            sizes = comm.all_gather_sizes(flat.shape[0], self.groups.dp, h.device)
            flat = comm.all_gather_dim(flat, 0, self.groups.dp, sizes)
            rank = comm.group_rank(self.groups.dp)
            own = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        if self.margin is not None:
            flat, weight = F.normalize(flat, dim=-1) * self.margin.scale, F.normalize(weight, dim=-1)
        per_rank_k = [min(k, size) for size in self.partition_sizes]
        my_k = per_rank_k[self.tp_rank]
        values, ids = [], []
        for lo in range(0, flat.shape[0], self._chunk()):
            z = F.linear(flat[lo : lo + self._chunk()], weight, self.bias)
            v, i = _local_topk_lowest_id(z, my_k)
            v = comm.all_gather_dim(v, 1, self.tp_group, per_rank_k)
            i = comm.all_gather_dim(i + self.class_start, 1, self.tp_group, per_rank_k)
            # Candidates arrive in ascending class id (rank order, ascending within a rank), so a
            # stable sort by value breaks ties towards the lower id.
            order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]
            values.append(softcapped(v.gather(1, order), self.softcap))
            ids.append(i.gather(1, order))
        lead = tuple(h.shape[:-1])
        if not values:  # empty batch
            dtype = autocast_dtype(h.device.type, h.dtype)
            return h.new_empty(lead + (k,), dtype=dtype), torch.empty(lead + (k,), dtype=torch.long, device=h.device)
        return torch.cat(values)[own].reshape(lead + (k,)), torch.cat(ids)[own].reshape(lead + (k,))


def _local_topk_lowest_id(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of each row of ``z`` with ties at the k-th value going to the lowest column.

    ``torch.topk`` does not promise which of several equal values it keeps, so it only gives the
    k-th value here; the selection is then explicit. Returns (values, columns), columns ascending.
    """
    n = z.shape[0]
    if k == 0:
        return z.new_empty(n, 0), torch.empty(n, 0, dtype=torch.long, device=z.device)
    z = torch.nan_to_num(z, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    kth = z.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = z > kth
    at_kth = z == kth
    missing = k - above.sum(dim=1, keepdim=True)
    take = above | (at_kth & (at_kth.cumsum(dim=1, dtype=torch.int32) <= missing))
    cols = take.nonzero()[:, 1].view(n, k)
    return z.gather(1, cols), cols
