"""What each style of a TP plan does: the one place its meaning is written.

A plan maps a module (or a parameter) to a style. A style says two things:

* how the parameters it covers are split over the TP group (`Style.split`: the dim, and how many
  packed blocks that dim holds; ``None`` keeps a parameter whole on every rank), and
* what crosses the group around the module's forward (`Style.enter` for the inputs, `Style.leave`
  for the output, `Style.parameters` for parameters used through a region), always through the
  autograd pairs of `bigdense.parallel.regions`.

A plan entry that names a *parameter* applies only the split. An entry that names a *module*
applies the split to the module's own parameters and the communication around its forward: the
module keeps its class and forward (`bigdense.parallelize.inplace`), except that a plain
``nn.Linear``/``nn.Embedding`` is replaced by bigdense's own layer (`Style.layer`), which computes
the same thing with sequence parallelism, overlap and input checks available.

The styles, by bigdense name (Hugging Face's names are in `bigdense.parallelize.hf.HF_STYLES`):

=================  ===========================================================================
``column``         output features split (``packed`` blocks each split on their own); input
                   replicated: the backward sums its gradient; ``gather_output`` gathers the
                   output; ``unit``: the split must fall on whole units of that many features
                   (attention heads), every rank holding as many
``row``            input features split; output summed over TP (forward all-reduce), the bias
                   added once after the sum; ``input_is_parallel=False`` splits the input here;
                   ``unit`` as for ``column``
``vocab``          an embedding's rows split; each rank looks up its rows, the outputs summed
``embedding_dim``  an embedding's columns split; every rank looks up its slice, the slices gathered
``partial_grad``   replicated parameters applied to this rank's share (per-head norms): their
                   gradients summed over TP
``sequence``       a per-token module run on this rank's share of the sequence, the shares
                   gathered back; its parameters' gradients summed
``partial_output`` floating-point inputs replicated, output a partial sum over TP (experts whose
                   weights are split by their own entries): input gradients and output summed
``divide_input``   the input divided by the TP size (an identity expert beside ``partial_output``
                   experts, whose outputs are summed over TP)
``experts``        a mixture-of-experts block's experts (``num_experts`` of them, their weights
                   ``(experts, ...)``): whole experts per rank, a balanced share; each rank runs
                   its own on the tokens routed to them (routes to other ranks' experts masked),
                   the partial outputs summed over TP, the input gradients summed
``by_expert``      a parameter split along its first dim, the experts (one an ``experts`` module
                   holds below it: a per-expert norm's weight)
``mla_kv_a``       the last ``rope_dim`` output features bypass the TP region that follows: their
                   gradient is summed
``local``          nothing: the module's parameters are split by their own entries
``replicate``      nothing: the module stays whole on every rank
``head``           an ``nn.Linear`` becomes a `ParallelClassifierHead` (its shard of the logits)
``per_feature``    a per-feature module on a column layer's shard of the features (between it
                   and a row layer): its 1-D parameters split with the features, nothing crosses
                   the group; an ``nn.BatchNorm1d``/``nn.SyncBatchNorm`` becomes a
                   `ShardedBatchNorm1d` (running statistics split too; ``sync_dp``)
=================  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
import torch.nn as nn

from ..layers import (
    ColumnParallelLinear, ParallelClassifierHead, RowParallelLinear, ShardedBatchNorm1d, VocabParallelEmbedding,
)
from ..layers.feature_norm import NORMS, PER_FEATURE_NORMS, per_feature_refusal
from ..parallel.partial_grads import with_partial_grad
from ..parallel.regions import (
    copy_to_tp, gather_from_tp, gather_sequence_shares, reduce_from_tp, scatter_to_sequence, scatter_to_tp,
)
from ..parallel.sharding import shard_range, shard_sizes

Split = Optional[tuple[int, int]]  # (dim, packed blocks), or None: whole on every rank


class StyleError(ValueError):
    """A style that cannot act on the module or parameter it names; the message says why."""


def _float_tensors_through(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with ``fn`` applied to every floating-point tensor."""
    def each(v):
        return fn(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return tuple(each(a) for a in args), {k: each(v) for k, v in kwargs.items()}


def _first_tensor(args: tuple, kwargs: dict, what: str, module) -> tuple[tuple, dict, Any]:
    """The module's main input: its first positional tensor (or keyword tensor), and a setter."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return a, lambda v: (args[:i] + (v,) + args[i + 1:], kwargs)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return v, lambda new: (args, {**kwargs, k: new})
    raise StyleError(f"{type(module).__name__}: style {what!r} expects a tensor input")


@dataclass(frozen=True)
class Style:
    """A plan style; subclasses set ``name`` and override what they change."""

    name = "replicate"
    layer_options: tuple = ()  # options for the bigdense layer that replaces a plain module (`layer`)
    splits_parameters = False  # whether a plan entry naming a parameter may have this style (it only splits)

    def split(self, module: nn.Module, name: str, param: torch.Tensor, *, whole_module: bool) -> Split:
        """How parameter ``name`` of ``module`` is split (``whole_module``: the entry names the
        module, not this parameter)."""
        return None

    def check(self, module: nn.Module, where: str) -> None:
        """Refuse a module this style cannot act on (a `StyleError` naming ``where``)."""

    def check_tp(self, module: nn.Module, where: str, tp: int) -> None:
        """Refuse a module this style cannot split over ``tp`` ranks."""

    def adapt(self, module: nn.Module) -> None:
        """Once, after a module converted in place got its split parameters: whatever else of it
        refers to positions in them (an embedding's padding row)."""

    def check_in_place(self, module: nn.Module, where: str) -> None:
        """Refuse what only a replacing layer could do, for a module converted in place."""
        if self.layer_options:
            raise StyleError(f"{where} is a {type(module).__name__}, converted in place: options "
                             f"{dict(self.layer_options)} apply to the bigdense layer that replaces a plain module only")

    def replaces(self, module: nn.Module) -> bool:
        """Whether a bigdense layer (`layer`) replaces ``module`` outright, rather than converting it
        in place: a plain ``nn.Linear``/``nn.Embedding`` of exactly that class."""
        return False

    def layer(self, module: nn.Module, tp_group) -> nn.Module:
        """The bigdense layer that replaces ``module`` (when `replaces`)."""
        raise NotImplementedError(self.name)

    def enter(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
        return args, kwargs, None

    def partial_grad_params(self, module) -> list[str]:
        """The module's parameters (its own, or of its children: dotted names), whole on every
        rank, that its forward applies to this rank's share only, so that their gradients are
        partial sums over TP."""
        return []

    def parameters(self, module) -> dict[str, Optional[torch.Tensor]]:
        """Parameters (dotted names allowed) the module's forward should see in place of its own,
        for this call: by default those of `partial_grad_params`, through `with_partial_grad`
        (summed over TP)."""
        return {n: with_partial_grad(module.get_parameter(n), module.tp_group) for n in self.partial_grad_params(module)}

    def leave(self, module, output, state):
        return output

    def describe(self) -> str:
        return self.name


def _output_dim(param: torch.Tensor) -> int:
    """The output-feature dim of a weight: ``(out, in)``, ``(experts, out, in)``, or a vector."""
    return max(param.dim() - 2, 0)


def _check_whole_units(module, where: str, style: str, features_attr: str, unit: int, tp: int) -> None:
    """Refuse a ``unit`` split (Hugging Face's ``unit_colwise``/``unit_rowwise``: whole attention
    heads of ``unit`` features) that would not give every rank the same number of whole units.
    transformers would hold such units on several ranks at once; a bigdense shard belongs to one
    rank, so it refuses instead (an attention whose heads do not divide stays whole before this)."""
    features = getattr(module, features_attr, None)
    if not isinstance(features, int):
        raise StyleError(f"{where} is a {type(module).__name__} without {features_attr}; style {style!r} with "
                         f"unit={unit} splits a linear layer's features in units")
    if features % unit or (features // unit) % tp:
        raise StyleError(f"{where}: style {style!r} splits its {features} {features_attr.replace('_', ' ')} in whole "
                         f"units of {unit}; {features / unit:g} units do not give each of {tp} ranks the same number")


@dataclass(frozen=True)
class Column(Style):
    name = "column"
    gather_output: bool = False
    packed: int = 1
    unit: int = 1
    splits_parameters = True

    def split(self, module, name, param, *, whole_module):
        dim = _output_dim(param)
        out = getattr(module, "out_features", None)
        if whole_module and out is not None and param.shape[dim] != out:
            raise StyleError(f"{type(module).__name__}.{name} {tuple(param.shape)} is not split with its {out} output "
                             f"features (dim {dim}), so style 'column' cannot split it")
        return dim, self.packed

    def check(self, module, where):
        if self.gather_output and self.packed > 1:
            raise StyleError(f"{where}: a packed column layer's output cannot be gathered in its global order")

    def check_tp(self, module, where, tp):
        if self.unit > 1:
            _check_whole_units(module, where, self.name, "out_features", self.unit, tp)

    def replaces(self, module):
        return type(module) is nn.Linear and self.packed == 1

    def layer(self, module, tp_group):
        return ColumnParallelLinear.from_dense(module, gather_output=self.gather_output, tp_group=tp_group,
                                               **dict(self.layer_options))

    def enter(self, module, args, kwargs):
        # The input is replicated and each rank's output uses it: its gradient is a partial sum.
        args, kwargs = _float_tensors_through(lambda t: copy_to_tp(t, module.tp_group), args, kwargs)
        return args, kwargs, None

    def leave(self, module, output, state):
        if not self.gather_output:
            return output
        sizes = shard_sizes(module.out_features, module.tp_size) if hasattr(module, "out_features") else None
        return gather_from_tp(output, module.tp_group, sizes)

    def describe(self):
        extra = [k for k, on in (("gathered", self.gather_output), (f"packed {self.packed}", self.packed > 1),
                                 (f"units of {self.unit}", self.unit > 1)) if on]
        return self.name + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class Row(Style):
    name = "row"
    input_is_parallel: bool = True
    packed: int = 1
    unit: int = 1
    splits_parameters = True

    def split(self, module, name, param, *, whole_module):
        if param.dim() == 1 and name == "bias":
            return None  # whole on every rank, added once after the sum
        dim = param.dim() - 1
        width = getattr(module, "in_features", None)
        if whole_module and width is not None and param.shape[dim] != width:
            raise StyleError(f"{type(module).__name__}.{name} {tuple(param.shape)} is not split with its {width} input "
                             f"features (dim {dim}), so style 'row' cannot split it")
        return dim, self.packed

    def check(self, module, where):
        if not self.input_is_parallel and self.packed > 1:
            raise StyleError(f"{where}: a packed row layer cannot split a replicated input in its packed order")

    def check_tp(self, module, where, tp):
        if self.unit > 1:
            _check_whole_units(module, where, self.name, "in_features", self.unit, tp)

    def replaces(self, module):
        return type(module) is nn.Linear and self.packed == 1

    def layer(self, module, tp_group):
        return RowParallelLinear.from_dense(module, input_is_parallel=self.input_is_parallel, tp_group=tp_group,
                                            **dict(self.layer_options))

    def enter(self, module, args, kwargs):
        if self.input_is_parallel:
            return args, kwargs, None
        x, put = _first_tensor(args, kwargs, self.name, module)
        sizes = shard_sizes(module.in_features, module.tp_size) if hasattr(module, "in_features") else None
        args, kwargs = put(scatter_to_tp(x, module.tp_group, sizes))
        return args, kwargs, None

    def parameters(self, module):
        return {"bias": None} if getattr(module, "bias", None) is not None else {}  # added once, in `leave`

    def leave(self, module, output, state):
        output = reduce_from_tp(output, module.tp_group)
        bias = getattr(module, "bias", None)
        return output if bias is None else output + bias.to(output.dtype)

    def describe(self):
        extra = [k for k, on in (("input split here", not self.input_is_parallel),
                                 (f"packed {self.packed}", self.packed > 1), (f"units of {self.unit}", self.unit > 1))
                 if on]
        return self.name + (f" ({', '.join(extra)})" if extra else "")


def _check_embedding(module, where, style):
    if not isinstance(module, nn.Embedding):
        raise StyleError(f"{where} is a {type(module).__name__}; style {style!r} splits an nn.Embedding")
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise StyleError(f"{where}: nn.Embedding with max_norm, sparse or scale_grad_by_freq cannot be split")


@dataclass(frozen=True)
class Vocab(Style):
    """Each rank looks its own rows up; a row owned elsewhere is looked up as local row 0 and its
    output zeroed *after* the module's forward, so whatever the module does to each looked-up row
    (a scale, a norm) happens on the owning rank only, and the sum over TP is exact."""

    name = "vocab"

    def split(self, module, name, param, *, whole_module):
        return (0, 1) if name == "weight" else None

    def check(self, module, where):
        _check_embedding(module, where, self.name)

    def partial_grad_params(self, module):
        # What the module does to a looked-up row with parameters of its own or of a child (a
        # norm's weight) happens on the row's owner only.
        return [n for n, _ in module.named_parameters() if n != "weight"]

    def adapt(self, module):
        if module.weight.shape[0] == 0:  # the module's own lookup cannot run on no rows
            raise StyleError(f"{type(module).__name__}: {module.num_embeddings} rows over {module.tp_size} ranks "
                             f"leave rank {module.tp_rank} none; converted in place, each rank needs one")
        # The padding row is one of this rank's rows, at its local index, or none of them.
        if module.padding_idx is not None:
            start, stop = shard_range(module.num_embeddings, module.tp_size, module.tp_rank)
            module.padding_idx = module.padding_idx - start if start <= module.padding_idx < stop else None

    def replaces(self, module):
        return type(module) is nn.Embedding

    def layer(self, module, tp_group):
        return VocabParallelEmbedding.from_dense(module, tp_group=tp_group, **dict(self.layer_options))

    def enter(self, module, args, kwargs):
        ids, put = _first_tensor(args, kwargs, self.name, module)
        start, stop = shard_range(module.num_embeddings, module.tp_size, module.tp_rank)
        elsewhere = (ids < start) | (ids >= stop)
        args, kwargs = put((ids - start).masked_fill(elsewhere, 0))
        return args, kwargs, elsewhere

    def leave(self, module, output, elsewhere):
        return reduce_from_tp(output.masked_fill(elsewhere.unsqueeze(-1), 0.0), module.tp_group)


@dataclass(frozen=True)
class EmbeddingDim(Style):
    name = "embedding_dim"

    def split(self, module, name, param, *, whole_module):
        return (1, 1) if name == "weight" else None

    def check(self, module, where):
        _check_embedding(module, where, self.name)

    def leave(self, module, output, state):
        return gather_from_tp(output, module.tp_group, shard_sizes(module.embedding_dim, module.tp_size))


@dataclass(frozen=True)
class PartialGrad(Style):
    name = "partial_grad"

    def partial_grad_params(self, module):
        return [n for n, _ in module.named_parameters(recurse=False)]


@dataclass(frozen=True)
class SequenceShare(Style):
    name = "sequence"

    def enter(self, module, args, kwargs):
        x, put = _first_tensor(args, kwargs, self.name, module)
        if x.dim() < 2:
            raise StyleError(f"{type(module).__name__}: style 'sequence' expects (*, S, d) inputs, got {tuple(x.shape)}")
        shares = tuple(shard_sizes(x.shape[-2], module.tp_size))
        args, kwargs = put(scatter_to_sequence(x, module.tp_group, shares))
        return args, kwargs, shares

    def partial_grad_params(self, module):
        return [n for n, _ in module.named_parameters(recurse=False)]

    def leave(self, module, output, shares):
        return gather_sequence_shares(output, module.tp_group, shares)


@dataclass(frozen=True)
class PartialOutput(Style):
    name = "partial_output"

    def enter(self, module, args, kwargs):
        args, kwargs = _float_tensors_through(lambda t: copy_to_tp(t, module.tp_group), args, kwargs)
        return args, kwargs, None

    def leave(self, module, output, state):
        if not isinstance(output, torch.Tensor):
            raise StyleError(f"{type(module).__name__}: style 'partial_output' expects a tensor output, "
                             f"got {type(output).__name__}")
        return reduce_from_tp(output, module.tp_group)


@dataclass(frozen=True)
class DivideInput(Style):
    name = "divide_input"

    def enter(self, module, args, kwargs):
        x, put = _first_tensor(args, kwargs, self.name, module)
        args, kwargs = put(x / module.tp_size)
        return args, kwargs, None


def _routing(module, args: tuple, kwargs: dict) -> tuple[list, Any]:
    """An experts module's call as ``([hidden states, expert indices, routing weights], put)``:
    the first floating-point tensor, the integer tensor and the second floating-point tensor, in
    call order (transformers names them differently from model to model), and a function that
    returns ``(args, kwargs)`` with those three replaced."""
    places = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    floats = [(k, t) for k, t in places if isinstance(t, torch.Tensor) and t.is_floating_point()]
    ints = [(k, t) for k, t in places if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if len(floats) != 2 or len(ints) != 1:
        got = [f"{k}: {t.dtype}" for k, t in places if isinstance(t, torch.Tensor)]
        raise StyleError(f"{type(module).__name__}: style 'experts' expects a call with hidden states, expert indices "
                         f"and routing weights (two floating-point tensors and one integer tensor), got {got}")
    keys = [floats[0][0], ints[0][0], floats[1][0]]

    def put(values):
        new = dict(zip(keys, values))
        return (tuple(new.get(i, a) for i, a in enumerate(args)), {k: new.get(k, v) for k, v in kwargs.items()})
    return [floats[0][1], ints[0][1], floats[1][1]], put


@dataclass(frozen=True)
class Experts(Style):
    """Whole experts per rank, the same rule as transformers' expert parallelism over a group that
    shares the batch (its ``all_reduce`` implementation), here over the TP group: the module's own
    parameters of ``num_experts`` rows are split along their first dim (a balanced share of the
    experts, uneven where they do not divide); each rank masks the routes to other ranks' experts
    (expert index ``num_experts`` on this rank, weight 0: transformers' experts skip it) and runs
    its own on every token routed to them; the outputs are partial sums, summed over TP. The
    inputs are replicated, so their gradients are partial sums too. Nothing depends on how an
    expert lays out its own weights (a fused [gate; up], an interleaved one, a transposed one)."""

    name = "experts"

    def split(self, module, name, param, *, whole_module):
        total = getattr(module, "bd_experts", (None, None, getattr(module, "num_experts", None)))[2]
        return (0, 1) if param.dim() >= 1 and param.shape[0] == total else None

    def check(self, module, where):
        if not isinstance(getattr(module, "num_experts", None), int):
            raise StyleError(f"{where} is a {type(module).__name__} without an integer num_experts; style 'experts' "
                             f"splits an experts module (transformers' fused experts) by whole experts")

    def check_tp(self, module, where, tp):
        if module.num_experts < tp:
            raise StyleError(f"{where}: {module.num_experts} experts cannot give each of {tp} ranks one")

    def adapt(self, module):
        total = module.num_experts
        start, stop = shard_range(total, module.tp_size, module.tp_rank)
        module.bd_experts = (start, stop, total)  # this rank's experts, and how many there are in all
        module.num_experts = stop - start  # the module's own forward counts its local experts
        module._is_expert_parallel = True  # transformers' batched and grouped experts then mask the off-rank rows

    def enter(self, module, args, kwargs):
        (hidden, index, weights), put = _routing(module, args, kwargs)
        start, stop, _ = module.bd_experts
        elsewhere = (index < start) | (index >= stop)
        local = torch.where(elsewhere, stop - start, index - start)  # stop - start: the index the experts skip
        hidden, weights = copy_to_tp(hidden, module.tp_group), copy_to_tp(weights, module.tp_group)
        args, kwargs = put([hidden, local, weights.masked_fill(elsewhere, 0.0)])
        return args, kwargs, None

    def leave(self, module, output, state):
        if not isinstance(output, torch.Tensor):
            raise StyleError(f"{type(module).__name__}: style 'experts' expects a tensor output, "
                             f"got {type(output).__name__}")
        return reduce_from_tp(output, module.tp_group)

    def describe(self):
        return "experts (whole experts per rank)"


@dataclass(frozen=True)
class ByExpert(Style):
    """A parameter split along its first dim, the experts, as the ``experts`` module holding it
    splits its own: for a per-expert parameter of a child (a per-expert norm's weight)."""

    name = "by_expert"
    splits_parameters = True

    def split(self, module, name, param, *, whole_module):
        return 0, 1

    def check(self, module, where):
        raise StyleError(f"{where} is a {type(module).__name__}; style 'by_expert' splits a parameter (name the "
                         f"parameter), the experts module itself is 'experts'")


@dataclass(frozen=True)
class MlaKvA(Style):
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (whole on every rank): its output is
    ``[latent | rope]``; the latent part goes through a norm into a column layer (whose backward
    sums its input gradient), the rope part straight into attention on this rank's heads, so only
    that part's gradient is partial."""

    name = "mla_kv_a"
    rope_dim: int = 0

    def check(self, module, where):
        if self.rope_dim <= 0:
            raise StyleError(f"{where}: style 'mla_kv_a' needs rope_dim > 0 (the model config's qk_rope_head_dim)")

    def leave(self, module, output, state):
        latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, copy_to_tp(rope, module.tp_group)], dim=-1)


@dataclass(frozen=True)
class Local(Style):
    name = "local"


@dataclass(frozen=True)
class Head(Style):
    name = "head"

    def check(self, module, where):
        if type(module) is not nn.Linear:
            raise StyleError(f"{where} is a {type(module).__name__}; style 'head' converts an nn.Linear")

    def replaces(self, module):
        return True

    def layer(self, module, tp_group):
        return ParallelClassifierHead.from_dense(module, tp_group=tp_group, **dict(self.layer_options))


@dataclass(frozen=True)
class PerFeature(Style):
    """A module acting on each feature alone (a BatchNorm1d, a per-feature scale and shift), on the
    shard of the features a column layer hands on: its parameters split with those features, so
    nothing crosses the group. An ``nn.BatchNorm1d``/``nn.SyncBatchNorm`` is replaced by a
    `ShardedBatchNorm1d` (options: ``sync_dp``, ``dp_group``); any other module is converted in
    place, its own 1-D parameters (of one length: its features) split."""

    name = "per_feature"

    def split(self, module, name, param, *, whole_module):
        return 0, 1

    def check(self, module, where):
        if isinstance(module, NORMS):
            why = per_feature_refusal(module, getattr(module, "num_features", -1))
            if why is not None:
                raise StyleError(f"{where}: style 'per_feature' cannot split it: {why}")
            return
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
        if not shapes or len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise StyleError(f"{where} is a {type(module).__name__}; style 'per_feature' splits a module's own 1-D "
                             f"parameters, all of one length (its features), got {shapes or 'none'}")
        whole = [f"buffer {n}" for n, b in module.named_buffers(recurse=False) if b is not None]
        whole += [f"child {n}" for n, c in module.named_children() if any(True for _ in c.parameters())]
        if whole:
            raise StyleError(f"{where}: style 'per_feature' splits only its own parameters; {whole} would stay whole")

    def check_in_place(self, module, where):
        super().check_in_place(module, where)
        if isinstance(module, NORMS):  # only when it shares a parameter with another module
            raise StyleError(f"{where} is a {type(module).__name__} sharing a parameter with another module: converted "
                             f"in place, its running statistics would stay whole")

    def replaces(self, module):
        return type(module) in PER_FEATURE_NORMS

    def layer(self, module, tp_group):
        return ShardedBatchNorm1d.from_dense(module, tp_group=tp_group, **dict(self.layer_options))


STYLES: dict[str, type[Style]] = {cls.name: cls for cls in (
    Column, Row, Vocab, EmbeddingDim, PartialGrad, SequenceShare, PartialOutput, DivideInput, Experts, ByExpert, MlaKvA,
    Local, Style, Head, PerFeature)}


_REPLACING = (Column, Row, Vocab, Head, PerFeature)  # styles whose bigdense layer takes further constructor options


def make_style(name: str, options: Optional[dict] = None, where: str = "plan") -> Style:
    """The style ``name`` with ``options``: its own fields, and for ``column``, ``row``, ``vocab``,
    ``head`` and ``per_feature`` any other option of the bigdense layer that replaces a plain module
    (checked when that layer is built). Unknown names and options are refused."""
    if name not in STYLES:
        raise StyleError(f"{where}: style {name!r} is not one of {sorted(STYLES)}")
    cls, options = STYLES[name], dict(options or {})
    own = {f.name for f in fields(cls)} - {"layer_options"}
    rest = {k: options.pop(k) for k in list(options) if k not in own}
    if rest and cls not in _REPLACING:
        raise StyleError(f"{where}: style {name!r} takes {sorted(own) or 'no options'}, not {sorted(rest)}")
    return cls(**options, layer_options=tuple(sorted(rest.items())))
