"""What FSDP2 (``engine=fsdp``, `bigdense.train.engines.fsdp`) keeps alive per rank, unit by unit.

`apply_fsdp` shards, over ``dp_shard = dp / dp_replicate`` ranks, each TP-local parameter along
dim 0 (``torch.chunk``: ``ceil(rows / dp_shard)`` rows each, the storage padded to that on every
rank), in units: each transformer block, the embeddings (``input``), the final norm with the head
(``output``) -- one ``tied`` unit when they share the embedding -- and the root (what is left).
Between steps a rank holds its fp32 shards of the parameters, of their gradients and of AdamW's two
moments. In the step, counted here on top of the activation model's moments (`GPTMemory`,
`HFMemory`), which see a module whose parameters and gradients are in the compute dtype
(``Layout.param_bytes``):

* a unit's gathered parameters (the padded unsharded tensors, in the compute dtype): the root's
  through the whole forward and backward; a block's from its forward to its end, and again in its
  backward (with ``engine.reshard_after_forward=false``: every unit's from its forward to its
  backward); the tied unit's through the forward (the embedding and the head are one unit) and from
  the head's backward to the end; the output unit's while the loss head runs (the fused loss is
  computed inside the head's forward: the GPT's, a Hugging Face model's on its fused path;
  ``loss_in_head``) and in its backward.
* FSDP's all-gather buffers: a unit's flat output, until its copy-out into the gathered parameters
  returns -- in the forward until the next unit's copy-out (the last one's until the root's forward
  returns, the loss included); in the backward the next block's, prefetched while the current one
  runs its backward.
* gradients: a unit's, formed unsharded in the compute dtype by its backward, are copied into a
  padded fp32 reduce-scatter input, whose output is the unit's sharded fp32 gradient; the last input
  is kept until the next unit's reduce-scatter or the backward's end, and the gradient of the unit's
  last parameter until its reduce-scatter returns (a loop variable); gloo (CPU) copies the input
  once more, NCCL does not. Units whose inputs need no gradient (the embeddings, so the tied unit,
  and the root) reduce at the end of the backward, their gradients and gathered parameters alive
  beside the embedding's backward (the position embedding's gradient comes after the token
  embedding's). With ``grad_accum`` > 1 the micro-batches before the last keep every unit's
  gradients unsharded, in fp32 (fp32 gradients of the later ones are added to them in place).

The moments (`FSDPMemory.moments`): the activation model's, each with what FSDP holds then, and
FSDP's own -- the head's unit gathered again as the backward starts (``head_gather``), each block at
the end of its backward and in its reduce-scatter (``block_end``, ``reduce_block``), the untied
head's and each end unit's reduce-scatter (``reduce_output``, ``reduce_<kind>``), the forward's
all-gathers (``gather``). Where activations are small (a large model, a small micro-batch) FSDP's
own moments set the peak.

Measured against the live tensor bytes of a real step (`bigdense.plan.measure`, gloo CPU processes):
see docs/memory-planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from ..models import CausalLM
from .layout import Layout


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit's parameters on the largest TP rank, in elements."""

    name: str
    kind: str  # "block", "input", "output", "tied" (input and output in one), "root"
    numel: int  # TP-local, unsharded
    padded: int  # the same with each tensor's dim 0 padded to a multiple of dp_shard (what a gather makes)
    shard: int  # one DP rank's (the padded shard every rank stores)
    trainable_numel: int = 0
    trainable_padded: int = 0
    trainable_shard: int = 0
    last_numel: int = 0  # its last trainable parameter's (FSDP's reduce keeps its gradient to the end)
    late_numel: int = 0  # trainable, of input modules but the token embedding (formed after its gradient)


def _sizes(shape: tuple[int, ...], ws: int) -> tuple[int, int, int]:
    """``(numel, padded, shard)`` of a TP-local tensor of ``shape`` split along dim 0 over ``ws`` ranks."""
    numel = math.prod(shape)
    rows = shape[0] if shape else 1
    rest = numel // rows if rows else 0
    per_rank = -(-rows // ws)
    return numel, per_rank * ws * rest, per_rank * rest


def _unit_modules(model: nn.Module) -> tuple[list[tuple[str, list[nn.Module]]], set]:
    """``[(kind, modules)]`` in the order `apply_fsdp` shards them: blocks, edges, and the root;
    and the ids of the input modules' parameters formed after the token embedding's gradient
    (all but the largest: a position embedding, run before it in the forward)."""
    from ..models.units import edge_units  # the engine's own grouping (tied edges: one unit)

    out, late = [("block", [b]) for b in (getattr(model, "blocks", None) or [])], set()
    if hasattr(model, "edges"):
        ins, outs = model.edges()
        inputs, outputs = set(map(id, ins)), set(map(id, outs))
        params = {id(p): p for m in ins for p in m.parameters()}
        late = set(params) - {max(params, key=lambda i: params[i].numel(), default=None)}
        for unit in edge_units(model):
            ids = set(map(id, unit))
            out.append(("tied" if ids & inputs and ids & outputs else "input" if ids & inputs else "output", unit))
    return out + [("root", [model])], late


def fsdp_units(model: nn.Module, entries, layout: Layout) -> list[Unit]:
    """The FSDP units of ``model`` (its parameters: ``entries``, `param_entries` at ``layout.tp``),
    each parameter in the first unit holding it; a Hugging Face model's as its `CausalLM` forms them."""
    from .hf import is_causal_lm

    wrapped = CausalLM(model) if is_causal_lm(model) and not isinstance(model, CausalLM) else model
    names = {id(p): n for n, p in model.named_parameters()}  # as `entries` name them
    by_name = {e.name: e for e in entries}
    taken, units = set(), []
    grouped, late_ids = _unit_modules(wrapped)
    for index, (kind, modules) in enumerate(grouped):
        sizes, last, late = [0] * 6, 0, 0
        for module in modules:
            for p in module.parameters():
                name = names.get(id(p))
                if name is None or name in taken or name not in by_name:
                    continue
                taken.add(name)
                entry = by_name[name]
                numel, padded, shard = _sizes(entry.local_shape(layout.tp, 0), layout.dp_shard)
                for i, v in enumerate((numel, padded, shard) * (2 if entry.trainable else 1)):
                    sizes[i] += v
                last = numel if entry.trainable else last
                late += numel if entry.trainable and id(p) in late_ids else 0
        if any(sizes[:3]):
            units.append(Unit(f"{kind}{index if kind == 'block' else ''}", kind, *sizes, last, late))
    return units


class FSDPMemory:
    """Per-rank bytes of FSDP's state, and the moments of a step under it."""

    def __init__(self, units: list[Unit], layout: Layout, *, loss_in_head: bool):
        self.units, self.layout, self.loss_in_head = units, layout, loss_in_head
        self.pb = layout.param_bytes
        self.blocks = [u for u in units if u.kind == "block"]
        self.kinds = {u.kind: u for u in units if u.kind != "block"}
        # Reduced at the end of the backward: units whose forward inputs need no gradient.
        self.at_end = [self.kinds[k] for k in ("tied", "input", "root") if k in self.kinds]
        self.keep = not layout.reshard_after_forward

    # ---- per unit ----
    def gathered(self, unit) -> int:
        return unit.padded * self.pb if unit is not None else 0

    def formed_grads(self, unit: Unit) -> int:
        """Its unsharded gradients as the backward forms them (the compute dtype)."""
        return unit.trainable_numel * self.pb

    def accumulated_grads(self, unit: Unit) -> int:
        """Its unsharded gradients kept between micro-batches (fp32, FSDP's reduce dtype)."""
        return unit.trainable_numel * 4

    def reduce_input(self, unit) -> int:
        return unit.trainable_padded * 4 if unit is not None else 0

    def sharded_grads(self, unit: Unit) -> int:
        return unit.trainable_shard * 4

    def reducing(self, unit: Unit) -> int:
        """Alive while ``unit`` reduce-scatters: the padded fp32 input and the output (its sharded
        gradients), the gradient of its last parameter (held by the reduce to its end), and on CPU
        gloo's copy of the input."""
        tail = unit.last_numel * (4 if self.layout.grad_accum > 1 else self.pb)
        gloo = self.reduce_input(unit) if self.layout.device_type == "cpu" else 0
        return self.reduce_input(unit) + self.sharded_grads(unit) + tail + gloo

    def _sum(self, fn, units) -> int:
        return sum(fn(u) for u in units)

    # ---- between steps ----
    def state_bytes(self) -> dict[str, int]:
        """fp32 shards of the parameters, their gradients and AdamW's two moments, per rank (no
        buckets; fused AdamW on the shards makes no temporaries)."""
        shard = sum(u.shard for u in self.units)
        trainable = sum(u.trainable_shard for u in self.units)
        return {"params": 4 * shard, "grads": 4 * trainable, "optimizer": 8 * trainable, "buckets": 0,
                "optimizer_temporaries": 0}

    def shard_numel(self) -> int:
        """Parameter elements one rank stores (its padded shards)."""
        return sum(u.shard for u in self.units)

    def trainable_shard_numel(self) -> int:
        """Of `shard_numel`, the elements that train."""
        return sum(u.trainable_shard for u in self.units)

    def persistent_grads(self) -> int:
        """Gradients alive through a micro-batch's forward: the unsharded fp32 ones accumulated by
        the micro-batches before it (``grad_accum`` > 1), else none (the sharded ones are cleared)."""
        return self._sum(self.accumulated_grads, self.units) if self.layout.grad_accum > 1 else 0

    # ---- the step ----
    def _flat(self, unit) -> int:
        """An all-gather's flat output (none over a single rank: the shard is copied in place)."""
        return self.gathered(unit) if self.layout.dp_shard > 1 else 0

    def _resident(self, *but) -> int:
        """Gathered parameters held from the forward through the backward: the root's, and with
        ``reshard_after_forward=false`` every unit's (but ``but``'s)."""
        held = self.units if self.keep else [u for u in self.units if u.kind == "root"]
        return self._sum(self.gathered, [u for u in held if u not in but])

    def moments(self, memory, base: float, temporaries: float = 0) -> dict[str, float]:
        """Bytes alive at each moment of the step: the activation model's (``memory``: `GPTMemory`,
        `HFMemory`) with FSDP's state (``base``: the parameter and optimizer shards), plus what FSDP
        holds then; and FSDP's own: the head's unit gathered again as the backward starts, the
        blocks' ends and reduce-scatters, the output and end units' reduce-scatters, the forward's
        all-gathers. Without an activation model (``memory`` None: a module the
        planner knows no activations of), the end of the backward and the optimizer step.
        ``temporaries``: the optimizer step's own (none for fused AdamW; Muon's, `bigdense.plan.muon_step`)."""
        k, grads = self.kinds, self.state_bytes()["grads"]
        if memory is None:
            return {"backward_end": base + grads + self._backward_end(0), "optimizer": base + grads + temporaries}
        moments = memory.moments(base, self.persistent_grads(), grads, temporaries)
        tied, resident = memory.tied_gradient_bytes(self.pb), self._resident()
        outputs = k.get("output") or k.get("tied")
        last_gathered = k.get("output") or (self.blocks[-1] if self.blocks else outputs)
        in_loss = self.gathered(outputs) if self.loss_in_head and not self.keep else 0
        in_backward = resident
        if not self.keep:  # the last block and the tied unit gathered, the next block's all-gather prefetched
            in_backward += self._sum(self.gathered, self.blocks[-1:]) + self.gathered(k.get("tied")) + self._sum(
                self._flat, self.blocks[-2:-1])
        if "output" in k and self.layout.grad_accum == 1:  # reduced after the final norm's backward
            out = k["output"]
            in_backward += self.reduce_input(out) + self.sharded_grads(out) - self.formed_grads(out) - self.gathered(
                out) * self.keep
        extras = {"forward": resident + in_loss + self._flat(last_gathered), "loss_backward": resident,
                  "backward": in_backward, "backward_end": self._backward_end(tied), "optimizer": 0}
        out = {name: v + extras[name] for name, v in moments.items()}
        out.update(self._reduce_moments(memory, base, grads, tied))
        out["gather"] = self._gather_moment(memory, base)
        if outputs is not None and not self.keep:  # the head's unit gathered again as the backward starts
            out["head_gather"] = (base + self.persistent_grads() + memory.stored_bytes() + memory.head_backward_bytes()
                                  + resident + self.gathered(outputs) + self._flat(outputs))
        return out

    def _gather_moment(self, memory, base: float) -> float:
        """The forward's all-gathers, each at its copy-out: the unit's flat output and its gathered
        parameters beside the previous unit's flat output (freed once the copy-out returns), the
        units still gathered and the activations so far."""
        k, rows = self.kinds, [b for _, b in memory.per_layer()]
        order = [u for u in [k.get("input") or k.get("tied"), *self.blocks, k.get("output")] if u]
        root, worst = self.gathered(k.get("root")), 0.0
        for j, unit in enumerate(order):
            before = order[:j]
            held = (self._sum(self.gathered, before) if self.keep
                    else self.gathered(k.get("tied")) * (unit.kind != "tied"))
            acts = sum(rows[: min(j, len(rows) - 1)]) if j else 0
            flats = self._flat(unit) + (self._flat(order[j - 1]) if j else 0)
            worst = max(worst, root + held + acts + flats + self.gathered(unit))
        return base + self.persistent_grads() + worst

    def _backward_end(self, tied: float) -> float:
        """The embedding's backward, beyond ``base + grads + tied``: the end units' gathered
        parameters and the gradients formed so far (not yet the position embedding's) instead of
        their shards, the last reduce-scatter input;
        with ``grad_accum`` > 1 the worse of a micro-batch before the last (every other unit's
        gradients accumulated unsharded) and the last (the end units' accumulated gradients too)."""
        end, others = self.at_end, [u for u in self.units if u not in self.at_end]
        last = self.blocks[0] if self.blocks else self.kinds.get("output")
        formed = self._sum(self.formed_grads, end) - sum(u.late_numel for u in end) * self.pb
        reduced = self._sum(self.gathered, end) - self._sum(self.sharded_grads, end) + self.reduce_input(last) + formed
        if self.layout.grad_accum == 1:
            return reduced
        accumulating = self._sum(self.gathered, end) + formed + self._sum(
            self.accumulated_grads, others) - self._sum(self.sharded_grads, self.units)
        return max(accumulating, reduced + self._sum(self.accumulated_grads, end))

    def _reduce_moments(self, memory, base: float, grads: float, tied: float) -> dict[str, float]:
        """Reduce-scatters (of the last micro-batch): the output unit's after the final norm's
        backward, beside every activation; the blocks' (`_block_moments`); each end unit's after
        the backward, beside the others' gathered parameters and gradients."""
        k, out = self.kinds, {}
        unreduced = self._sum(self.accumulated_grads, self.units) if self.layout.grad_accum > 1 else 0
        if "output" in k:
            o = k["output"]
            out["reduce_output"] = (base + unreduced - self.accumulated_grads(o) * bool(unreduced)
                                    + memory.stored_bytes() + self._resident(o)
                                    + self._flat(self.blocks[-1] if self.blocks and not self.keep else None)
                                    + self.reducing(o))
        out.update(self._block_moments(memory, base))
        for u in self.at_end:
            others = [v for v in self.at_end if v is not u]
            held = self._sum(self.gathered, others) + self._sum(self.formed_grads, others) + (
                self._sum(self.accumulated_grads, others) if self.layout.grad_accum > 1 else 0)
            reduced = grads - self._sum(self.sharded_grads, self.at_end)  # every other unit's shards
            out[f"reduce_{u.kind}"] = base + reduced + held + self.reducing(u)
        return out

    def _block_moments(self, memory, base: float) -> dict[str, float]:
        """The blocks' backwards, last block first, each at its end (its gradients formed, beside
        its gathered parameters) and in its reduce-scatter: beside the activations below it, the
        head's gradients (tied: unsharded; else the output unit's shards), the shards of the blocks
        already reduced, the previous reduce-scatter input (until this one's) and the next unit's
        prefetched all-gather output. Where activations are small these outlast the first block's
        backward (``backward``)."""
        k, n, ga = self.kinds, len(self.blocks), self.layout.grad_accum
        rows = [b for _, b in memory.per_layer()]  # embedding, blocks..., final norm
        tied, out = k.get("tied"), k.get("output")
        head = self.formed_grads(tied) - tied.late_numel * self.pb if tied else self.sharded_grads(out) if out else 0
        end = reduce = 0.0
        for i in reversed(range(n)):
            b, later = self.blocks[i], self.blocks[i + 1:]
            unreduced = self._sum(self.accumulated_grads, self.blocks[: i + 1] + self.at_end) if ga > 1 else 0
            retained = self.reduce_input(self.blocks[i + 1] if later else out)
            following = self.blocks[i - 1] if i else k.get("input")
            gathered = self._resident(b, out, *later) if self.keep else (
                self._resident() + self.gathered(tied) + self._flat(following))
            alive = base + unreduced + sum(rows[: i + 1]) + head + gathered + self._sum(self.sharded_grads, later)
            # fp32 gradients of later micro-batches are added in place to the accumulated ones.
            formed = 0 if ga > 1 and self.pb == 4 else self.formed_grads(b)
            end = max(end, alive + retained + self.gathered(b) + formed)
            reduce = max(reduce, alive - self.accumulated_grads(b) * (ga > 1) + self.reducing(b))
        return {"block_end": end, "reduce_block": reduce} if n else {}

    def gathered_peak(self) -> int:
        """The most bytes of gathered parameters and all-gather buffers alive at once (for the table)."""
        k, flat = self.kinds, self._flat(self.blocks[-1] if self.blocks else None)
        if self.keep:
            return self._sum(self.gathered, self.units) + flat
        always = self._sum(self.gathered, [k[n] for n in ("root", "tied") if n in k])
        edge = max([self.gathered(k[n]) for n in ("input", "output") if n in k] + [0])
        return always + max(edge, self._sum(self.gathered, self.blocks[-1:])) + flat
