"""`check_parallel`: is a model converted by `bd.parallelize` exact? Find out on CPU before GPU hours.

    report = bigdense.testing.check_parallel(build_model, {"input_ids": ids, "labels": ids}, tp=(2, 3), steps=1)
    report.exact                 # every TP size: outputs and gradients within fp32 round-off
    report.results[2].first_mismatch   # the module at fault: the first (in execution order) that disagrees

For each TP size, that many CPU gloo ranks (`run_ranks`) each build the plain model
(``build_model()`` after ``torch.manual_seed(seed)``: every rank the same weights), convert a copy
with `parallelize`, and run both on the same batch: forward, backward, an SGD step, ``steps``
times, then a last forward. Compared, on every rank:

* every output of the model (a tensor, a tuple, a ``ModelOutput``'s fields) at every forward;
* every parameter's gradient: this rank's shard against the same slice of the plain one;
* every module's output in the first forward, in execution order, to name the *first* module that
  disagrees: an output TP splits (a column layer's, not gathered; a per-feature module's) is
  gathered by the module's own split first, and a row layer's split input is compared, gathered, with
  the plain layer's input. Where that input is the first thing to disagree, the fault lies between
  the column layers whose split outputs it was computed from (found through the autograd graph) and
  the row layer: when the input is the plain input's balanced split (what element-wise code on
  correctly split column outputs hands on) the row layer's own split is wrong and it is named,
  otherwise the earliest of those column layers is (a ``[gate; up]`` projection split as one block,
  whose halves the code between then cuts on each rank). Other activations inside a TP region,
  which no module's split describes, are skipped.

The loss is the model's ``.loss`` output when it has one (Hugging Face models given labels), else
``loss_fn(output)``, else the mean square of its first floating-point output. Differences are
reported as the largest absolute difference and relative to the largest magnitude of the plain
value; a conversion is exact when every one is within ``rtol`` (default 1e-4: the TP sums only
reorder fp32 additions, which moves values by about 1e-7 relative per operation, while a wrong
slice or a missing sum moves them by order 1) of its own magnitude, or of a thousandth of the
largest of its kind for a much smaller one. Both models run each forward with the random number
generators at the same seed, so what they draw alike (a router's jitter, dropout on replicated
activations) is the same; dropout on activations TP splits is drawn differently.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..layers import ColumnParallelLinear, RowParallelLinear, ShardedBatchNorm1d
from ..layers.base import TensorParallelModule, gather_shards
from ..parallel import comm
from ..parallel.sharding import ShardSpec, shard_range
from .ranks import run_ranks

Diff = tuple[float, float]  # (largest |difference|, largest |plain value|)


@dataclass
class ModuleDiff:
    """A module's output in the first forward against the plain module's (gathered when TP splits
    it), or (``input``) a row layer's split input, gathered, against the plain layer's input."""

    name: str
    diff: Diff
    input: bool = False
    as_balanced: Optional[Diff] = None  # an input: this rank's against the plain input's balanced split
    producers: tuple[str, ...] = ()  # an input: the split outputs it was computed from, in execution order

    @property
    def label(self) -> str:
        return f"{self.name} (input)" if self.input else self.name

    def blamed(self, rtol: float) -> str:
        """The module at fault when this is the first difference beyond ``rtol``."""
        if not self.input or not self.producers or (self.as_balanced and not beyond({"": self.as_balanced}, rtol)):
            return self.name
        return self.producers[0]


@dataclass
class RankComparison:
    """One rank's comparison at one TP size."""

    outputs: dict[str, Diff] = field(default_factory=dict)  # "step N/<output name>"
    grads: dict[str, Diff] = field(default_factory=dict)  # "step N/<parameter name>"
    modules: list[ModuleDiff] = field(default_factory=list)  # in execution order, first forward
    conversion: str = ""


@dataclass
class CheckResult:
    """The comparison at one TP size, over its ranks (the largest difference of any rank)."""

    tp: int
    outputs: dict[str, Diff]
    grads: dict[str, Diff]
    first_mismatch: Optional[str]
    conversion: str
    rtol: float

    def _bad(self, diffs: dict[str, Diff]) -> dict[str, Diff]:
        return beyond(diffs, self.rtol)

    @property
    def exact(self) -> bool:
        return not self._bad(self.outputs) and not self._bad(self.grads)

    def describe(self) -> str:
        def worst(diffs):
            if not diffs:
                return "nothing compared"
            key, (diff, scale) = max(diffs.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-6))
            return f"{diff:.2e} ({diff / max(scale, 1e-6):.1e} relative) at {key}"
        verdict = "exact" if self.exact else "DIFFERS"
        lines = [f"tp={self.tp}: {verdict}; outputs: {worst(self.outputs)}; gradients: {worst(self.grads)}"]
        if not self.exact:
            bad = {**self._bad(self.outputs), **self._bad(self.grads)}
            lines.append(f"  beyond rtol={self.rtol:g}: {sorted(bad)[:8]}")
            lines.append(f"  first module that disagrees: {self.first_mismatch or 'none found (see the outputs)'}")
        return "\n".join(lines)


def beyond(diffs: dict[str, Diff], rtol: float) -> dict[str, Diff]:
    """The differences beyond ``rtol`` of their value's magnitude, floored at 1e-3 of the largest
    of its kind: a gradient a thousand times smaller than the others keeps the others' round-off."""
    floor = 1e-3 * max((scale for _, scale in diffs.values()), default=0.0)
    return {k: d for k, d in diffs.items() if d[0] > rtol * max(d[1], floor, 1e-12)}


@dataclass
class ParallelCheck:
    """`check_parallel`'s answer: a `CheckResult` per TP size."""

    results: dict[int, CheckResult]

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.results.values())

    def __str__(self) -> str:
        return "\n".join(r.describe() for r in self.results.values())


def _flat_outputs(output, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a model's output, by name."""
    if isinstance(output, torch.Tensor):
        return {prefix or "output": output} if output.is_floating_point() else {}
    items = output.items() if hasattr(output, "items") else enumerate(output) if isinstance(output, (tuple, list)) else ()
    out = {}
    for key, value in items:
        out.update(_flat_outputs(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _diff(got: torch.Tensor, want: torch.Tensor) -> Diff:
    got, want = got.detach().double(), want.detach().double()
    if got.numel() == 0:
        return 0.0, 0.0
    return float((got - want).abs().max()), float(want.abs().max())


def _loss(output, loss_fn):
    if loss_fn is not None:
        return loss_fn(output)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(iter(_flat_outputs(output).values()))
    return first.float().square().mean()


@dataclass
class _Seen:
    """A module's first floating-point output (or input) in one call: a copy, and the node of the
    autograd graph that made it."""

    name: str
    call: int  # the how-manieth call of that module in this forward
    input: bool
    value: torch.Tensor
    node: Any


def _first_float(value) -> Optional[torch.Tensor]:
    return next(iter(_flat_outputs(value).values()), None)


def _record_calls(model: nn.Module, into: list, inputs_of: frozenset, skip: frozenset = frozenset()) -> list:
    """Hooks appending a `_Seen` to ``into`` for every module's output, and for the modules named in
    ``inputs_of`` their input too, in execution order."""
    calls: dict[tuple[str, bool], int] = {}

    def seen(name: str, is_input: bool, value) -> None:
        tensor = _first_float(value)
        if tensor is not None:
            call = calls[name, is_input] = calls.get((name, is_input), -1) + 1
            into.append(_Seen(name, call, is_input, tensor.detach().clone(), tensor.grad_fn))

    hooks = []
    for name, module in model.named_modules():
        if name and name not in skip:
            hooks.append(module.register_forward_hook(lambda m, a, out, n=name: seen(n, False, out)))
            if name in inputs_of:
                hooks.append(module.register_forward_pre_hook(lambda m, args, n=name: seen(n, True, args)))
    return hooks


def _split_activation(module: nn.Module, side: str) -> Optional[ShardSpec]:
    """How TP splits the last dim of a converted module's ``"output"`` or ``"input"``: like the
    module's weight (its sizes and packed blocks); ``None`` when it is whole on every rank. Split:
    a column layer's output when not gathered, a per-feature module's output, a row layer's input
    when ``input_is_parallel``."""
    if not isinstance(module, TensorParallelModule) or module.tp_size == 1:
        return None
    style = getattr(module, "bd_style", None)  # a module converted in place: its plan style
    kind = getattr(style, "name", None)
    if side == "output":
        split = ((isinstance(module, ColumnParallelLinear) and not module.gather_output)
                 or isinstance(module, ShardedBatchNorm1d) or kind == "per_feature"
                 or (kind == "column" and not style.gather_output))
    else:
        split = ((isinstance(module, RowParallelLinear) and module.input_is_parallel)
                 or (kind == "row" and style.input_is_parallel))
    specs = module.bd_shard_specs()
    return (specs.get("weight") or next(iter(specs.values()), None)) if split else None


def _gathered(model: nn.Module, seen: list[_Seen]) -> list[Optional[torch.Tensor]]:
    """Each recorded value whole: gathered by its module's split (a collective, in the same order on
    every rank), or as it is when nothing splits it. A split value whose width is not its module's
    split on some rank (a module whose output is not its weight's features) is left out (None) on
    every rank, which one all-reduce of flags agrees on first."""
    specs = [_split_activation(model.get_submodule(s.name), "input" if s.input else "output") for s in seen]
    split = [i for i, spec in enumerate(specs) if spec is not None]
    fits = [float(seen[i].value.dim() > 0 and seen[i].value.shape[-1] == specs[i].local_shape[specs[i].dim])
            for i in split]
    group = model.get_submodule(seen[split[0]].name).tp_group if split else None
    agreed = comm.all_reduce_(torch.tensor(fits), group, op=torch.distributed.ReduceOp.MIN) if split else ()
    out = [s.value if spec is None else None for s, spec in zip(seen, specs)]
    for i, ok in zip(split, agreed):
        if ok:
            out[i] = gather_shards(seen[i].value, specs[i], model.get_submodule(seen[i].name).tp_group, dim=-1)
    return out


def _producers(node, made_by: dict, order: dict) -> tuple[str, ...]:
    """The modules whose recorded split outputs the tensor of autograd node ``node`` was computed
    from, walking the graph back to them (not past them), in execution order."""
    found, stack, visited = set(), [node], set()
    while stack:
        current = stack.pop()
        if current is None or current in visited:
            continue
        visited.add(current)
        if current in made_by:
            found.add(made_by[current])
            continue
        stack.extend(nxt for nxt, _ in current.next_functions)
    return tuple(sorted(found, key=order.get))


def _compare_modules(model: nn.Module, seen: list[_Seen], seen_ref: list[_Seen]) -> list[ModuleDiff]:
    """This rank's `ModuleDiff`s of the first forward (see the module docstring)."""
    plain = {(s.name, s.call, s.input): s.value for s in seen_ref}
    split_outputs = [s for s in seen if not s.input and _split_activation(model.get_submodule(s.name), "output")]
    made_by = {s.node: s.name for s in split_outputs if s.node is not None}
    order = {s.name: i for i, s in reversed(list(enumerate(split_outputs)))}
    diffs = []
    for s, whole in zip(seen, _gathered(model, seen)):
        want = plain.get((s.name, s.call, s.input))
        if whole is None or want is None or whole.shape != want.shape:
            continue
        diff = ModuleDiff(s.name, _diff(whole, want), s.input)
        if s.input:
            diff.as_balanced = _balanced_diff(s.value, want, model.get_submodule(s.name))
            diff.producers = _producers(s.node, made_by, order)
        diffs.append(diff)
    return diffs


def _balanced_diff(local: torch.Tensor, plain: torch.Tensor, module) -> Optional[Diff]:
    """This rank's input against the balanced contiguous split of the plain input's last dim."""
    start, stop = shard_range(plain.shape[-1], module.tp_size, module.tp_rank)
    if local.shape[-1] != stop - start:
        return None
    return _diff(local, plain.narrow(-1, start, stop - start))


def _inside_converted(model: nn.Module) -> frozenset:
    """Modules inside a converted one: they run on this rank's share, before the converted module's
    communication, so their outputs are not the plain model's."""
    converted = [n for n, m in model.named_modules() if isinstance(m, TensorParallelModule)]
    return frozenset(n for n, _ in model.named_modules() if any(n.startswith(c + ".") for c in converted if c))


def _call_seeded(model, batch, seed: int):
    """The model on ``batch`` with the random number generators at ``seed``: both models draw the
    same numbers for what they draw alike (a router's jitter, dropout on a replicated activation)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if isinstance(batch, dict):
            return model(**batch)
        return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def converted_pair(build_model: Callable[[], nn.Module], plan=None, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """``(plain model, its converted copy)``: ``build_model()`` after ``torch.manual_seed(seed)``,
    and a copy converted by `parallelize` (every rank of the default context calls it together)."""
    from ..parallelize import parallelize

    torch.manual_seed(seed)
    reference = build_model()
    return reference, parallelize(copy.deepcopy(reference), plan)


def compare_pair(reference: nn.Module, model: nn.Module, batch, *, steps: int = 1, lr: float = 1e-2, loss_fn=None,
                 seed: int = 0) -> RankComparison:
    """This rank's comparison of a plain model with its converted copy (see the module docstring);
    both are trained ``steps`` SGD steps. Every rank of the default parallel context calls it together."""
    from ..layers.base import named_shard_specs

    result = RankComparison(conversion=model.bd_parallel_report.summary(type(model).__name__))
    specs, inside = named_shard_specs(model), _inside_converted(model)
    ref_params, params = dict(reference.named_parameters()), dict(model.named_parameters())
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    split_inputs = frozenset(n for n, m in model.named_modules() if n not in inside and _split_activation(m, "input"))
    for step in range(steps + 1):
        seen_ref, seen = [], []
        hooks = (_record_calls(reference, seen_ref, split_inputs) + _record_calls(model, seen, split_inputs, inside)
                 if step == 0 else [])
        out_ref, out = (_call_seeded(m, batch, seed + step) for m in (reference, model))
        for h in hooks:
            h.remove()
        want = _flat_outputs(out_ref)
        for name, got in _flat_outputs(out).items():
            if name in want and got.shape == want[name].shape:
                result.outputs[f"step {step}/{name}"] = _diff(got, want[name])
        if step == 0:
            result.modules = _compare_modules(model, seen, seen_ref)
        if step == steps:
            break
        _loss(out_ref, loss_fn).backward()
        _loss(out, loss_fn).backward()
        for name, p in params.items():
            ref = ref_params[name]
            if p.grad is None or ref.grad is None:
                continue
            spec = specs.get(name)
            result.grads[f"step {step}/{name}"] = _diff(p.grad, spec.slice_of(ref.grad) if spec else ref.grad)
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    return result


def compare_fused_loss(reference: nn.Module, causal_lm: nn.Module, x: torch.Tensor, y: torch.Tensor,
                       seed: int = 0) -> dict[str, Diff]:
    """A `bigdense.models.CausalLM` around the converted copy of ``reference`` (the same weights)
    against ``F.cross_entropy`` of the plain model's own logits (-100 ignored): ``{"loss": ...,
    "grad/<name>": ...}`` for the loss and every parameter's gradient, this rank's shard against the
    same slice of the plain one. Both forwards run with the random streams at ``seed``; gradients
    are cleared before and after."""
    from ..layers.base import named_shard_specs

    import torch.nn.functional as F

    for m in (reference, causal_lm):
        m.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        logits = reference(input_ids=x, use_cache=False).logits
    want = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        got = causal_lm(x, y)
    want.backward()
    got.backward()
    diffs = {"loss": _diff(got, want)}
    specs, plain = named_shard_specs(causal_lm.lm), dict(reference.named_parameters())
    for name, p in causal_lm.lm.named_parameters():
        ref = plain[name]
        if p.grad is None and ref.grad is None:
            continue
        spec = specs.get(name)
        want_grad = torch.zeros_like(ref) if ref.grad is None else ref.grad
        got_grad = torch.zeros_like(p) if p.grad is None else p.grad
        diffs[f"grad/{name}"] = _diff(got_grad, spec.slice_of(want_grad) if spec else want_grad)
    for m in (reference, causal_lm):
        m.zero_grad(set_to_none=True)
    return diffs


def compare_on_this_rank(build_model: Callable[[], nn.Module], batch, *, steps: int = 1, plan=None, lr: float = 1e-2,
                         loss_fn=None, seed: int = 0) -> RankComparison:
    """`converted_pair` then `compare_pair`, on this rank."""
    reference, model = converted_pair(build_model, plan, seed)
    return compare_pair(reference, model, batch, steps=steps, lr=lr, loss_fn=loss_fn, seed=seed)


def _on_each_rank(tp, build_model, batch, steps, plan, lr, loss_fn, seed) -> RankComparison:
    from ..parallel.context import init_parallel

    init_parallel(tp=tp)
    return compare_on_this_rank(build_model, batch, steps=steps, plan=plan, lr=lr, loss_fn=loss_fn, seed=seed)


def merge(tp: int, per_rank: list[RankComparison], rtol: float) -> CheckResult:
    """The ranks' comparisons at one TP size as one `CheckResult` (the largest differences)."""
    def largest(dicts):
        out: dict[str, Diff] = {}
        for d in dicts:
            for key, (diff, scale) in d.items():
                old = out.get(key, (0.0, 0.0))
                out[key] = (max(old[0], diff), max(old[1], scale))
        return out
    first = None
    for comparison in per_rank:  # the first rank's earliest module that disagrees
        bad = beyond({m.label: m.diff for m in comparison.modules}, rtol)
        first = first or next((m.blamed(rtol) for m in comparison.modules if m.label in bad), None)
    return CheckResult(tp, largest(c.outputs for c in per_rank), largest(c.grads for c in per_rank), first,
                       per_rank[0].conversion, rtol)


def check_parallel(build_model: Callable[[], nn.Module], batch: Any, tp=(2, 3), steps: int = 1, *, plan=None,
                   lr: float = 1e-2, loss_fn=None, rtol: float = 1e-4, seed: int = 0, timeout: float = 600.0,
                   verbose: bool = True) -> ParallelCheck:
    """Compare ``build_model()`` converted by `parallelize` (``plan``: as `parallelize` takes it)
    with the unconverted model on ``batch`` at each TP size of ``tp``, on CPU gloo ranks (see the
    module docstring); returns (and with ``verbose`` prints) a `ParallelCheck`.

    ``build_model`` builds the plain model (called on every rank after ``torch.manual_seed(seed)``,
    so it must build the same weights each time); ``batch`` is what the model is called with (a
    dict of keyword arguments, a tuple of arguments, or one tensor).
    """
    results = {}
    for size in (tp,) if isinstance(tp, int) else tuple(tp):
        per_rank = run_ranks(_on_each_rank, size, size, build_model, batch, steps, plan, lr, loss_fn, seed,
                             timeout=timeout)
        results[size] = merge(size, per_rank, rtol)
    check = ParallelCheck(results)
    if verbose:
        print(check)
    return check
