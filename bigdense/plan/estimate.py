"""`estimate`: parameters, memory per rank by category, the peak and FLOPs of one training step.

The peak is the largest of the moments a step passes through, each a sum of what is alive then
(steady state, after the first step, with the engines of `bigdense.train.engines`):

* ``forward`` -- the end of the forward, inside the loss head: parameters, optimizer state,
  gradients that persist between steps (DDP buckets when dp > 1, accumulation over micro-batches,
  ZeRO partitions), every stored activation, the head's gradients (the fused cross-entropy forms
  them in the forward) and its chunk buffers (`bigdense.plan.fused_head`; a Hugging Face model
  with ``fused_loss=False``: all the logits, their fp32 copy and log-softmax's output);
* ``loss_backward`` (a Hugging Face model on the gathered path only, `bigdense.plan.hf`) --
  log-softmax's backward over the full logits: three fp32 logits-sized tensors beside every stored
  activation;
* ``backward`` -- the first block's backward: the same, the head's gradients, and the block's
  gradients of activations (and its recomputed activations); for a Hugging Face model the largest
  of its layers' backwards, each with the parameter gradients formed before it;
* ``backward_end`` -- every gradient; with a tied embedding and head, the embedding's dense
  gradient and its sum with the head's gradient, both alive next to the head's;
* ``optimizer`` -- every gradient and the optimizer's temporaries (none for the DDP engine's fused
  AdamW; DeepSpeed's torch AdamW: two of the largest parameter on CPU, one of all parameters with
  the foreach kernels on GPUs; Muon's step, `bigdense.plan.muon_step`, on its busiest rank).

With ``engine="fsdp"`` the state is FSDP's fp32 shards, each moment adds the gathered parameters and
buffers alive then, and FSDP's own moments join them (`bigdense.plan.fsdp`: ``block_end``,
``reduce_block``, ``reduce_output``, ``reduce_tied`` / ``reduce_input`` / ``reduce_root``, ``gather``).

``overhead`` (CUDA context, communication library, allocator slack) is added on top of the peak
for the total held against the device.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

import torch.nn as nn

from ..layers.lora import lora_settings
from ..models import CausalLM
from ..models.gpt import GPT
from .count import bytes_per_rank, count_per_rank, param_entries
from .fsdp import FSDPMemory, fsdp_units
from .gpt import GPTAdapters, GPTMemory, GPTShape
from .hf import HFMemory, HFShape, is_causal_lm
from .layout import Layout
from .muon import MuonPlan, MuonSettings, plan_muon

GiB = 2**30
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass
class Estimate:
    """Per-rank figures of one layout (the largest rank's, shards being balanced)."""

    layout: Layout
    total_params: int  # unsharded, each tied weight once
    params_per_rank: int  # elements a rank holds: its TP shard (FSDP: its padded DP shard of that)
    bytes_per_rank: dict  # category -> bytes
    trainable_params: int = 0  # unsharded, of those that train (low-rank adapters: theirs alone)
    trainable_per_rank: int = 0  # of `params_per_rank`, those that train
    phases: dict = field(default_factory=dict)  # moment of the step -> bytes alive
    peak_bytes: int = 0  # tensors alive at the worst moment (what max_memory_allocated reports)
    peak_phase: str = ""
    overhead_bytes: int = 0
    flops_per_step: float = 0.0  # per rank
    activations_per_layer: list = field(default_factory=list)  # [(name, bytes)]
    tp_collective_bytes: float = 0.0  # per step per rank: the TP collectives' tensors (`tp_collective_bytes`)
    step_time_s: Optional[float] = None
    muon: Optional[MuonPlan] = None  # optim.name=muon: its state, exchange, FLOPs and step transient per rank

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    def fits(self, device_bytes: float) -> bool:
        return self.total_bytes <= device_bytes

    def to_json(self) -> dict:
        out = asdict(self)
        out["layout"] = asdict(self.layout)
        out["total_bytes"] = self.total_bytes
        out["overrides"] = self.layout.overrides()
        return out

    def table(self, device_bytes: Optional[float] = None) -> str:
        """The per-rank memory table printed by ``python -m bigdense.plan``."""
        rows = [("parameters", f"{self.params_per_rank:,} of {self.total_params:,}", ""),
                ("trainable", f"{_short(self.trainable_params)} of {_short(self.total_params)} "
                 f"({100 * self.trainable_params / max(self.total_params, 1):.2f}%)", "")]
        rows += [(k, f"{v / GiB:9.3f} GiB", "") for k, v in self.bytes_per_rank.items()]
        rows += [(f"peak ({self.peak_phase})", f"{self.peak_bytes / GiB:9.3f} GiB", ""),
                 ("total (peak + overhead)", f"{self.total_bytes / GiB:9.3f} GiB",
                  "" if device_bytes is None else f"of {device_bytes / GiB:.1f} GiB: "
                  + ("fits" if self.fits(device_bytes) else "DOES NOT FIT")),
                 ("FLOPs per step per rank", f"{self.flops_per_step:.3e}", "")]
        if self.layout.tp > 1 and self.tp_collective_bytes:
            rows.append(("TP collectives per step", f"{self.tp_collective_bytes / GiB:9.3f} GiB", ""))
        rows += _muon_rows(self.muon) if self.muon is not None else []
        width = max(len(r[0]) for r in rows)
        lines = [f"per rank, {' '.join(self.layout.overrides())}"]
        lines += [f"  {name:<{width}}  {value}  {note}".rstrip() for name, value, note in rows]
        if self.activations_per_layer:
            lines.append("  activations by layer: " + ", ".join(
                f"{n} {b / 2**20:.1f} MiB" for n, b in self.activations_per_layer))
        return "\n".join(lines)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _muon_rows(muon: MuonPlan) -> list[tuple[str, str, str]]:
    """The table's Muon rows: the busiest rank's figures, and what they are made of."""
    other = [f"{s}: {n}" for s, n in muon.collectives.items() if s != muon.scheme]
    return [("Muon exchange per step", f"{muon.busiest('sent_bytes') / GiB:9.3f} GiB",
             f"sent by the busiest rank ({muon.ns_dtype}); {muon.collectives[muon.scheme]} all-to-alls "
             f"({muon.scheme}; {', '.join(other)}), {muon.matrices} matrices in {muon.rounds} rounds"),
            ("Muon Newton-Schulz FLOPs", f"{muon.busiest('ns_flops'):.3e}",
             f"per step on the busiest rank (least: {min(muon.ns_flops):.3e})"),
            ("Muon step transient", f"{muon.busiest('step_bytes') / GiB:9.3f} GiB",
             "the busiest rank's, in the optimizer moment")]


def _short(n: int) -> str:
    """A parameter count as people write it: 1.2M, 124M, 7.0B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)


def _state_bytes(params: int, trainable: int, largest: int, layout: Layout) -> dict:
    """Parameters, gradients, optimizer state (AdamW) and communication buckets, per rank."""
    dp, zero, pb = layout.dp, layout.zero, layout.param_bytes
    grads = trainable * pb
    optimizer = 8 * trainable  # AdamW's two fp32 moments
    if layout.engine == "deepspeed":
        optimizer += 4 * trainable  # ZeRO's fp32 master partition (also in fp32 runs)
        if zero >= 1:
            optimizer /= dp
        if zero >= 2:
            grads = grads / dp
    buckets = 0
    if layout.engine == "deepspeed" and zero == 2:
        buckets = min(DS_REDUCE_BUCKET, trainable) * pb  # contiguous_gradients' reduce buffer
    if layout.engine != "deepspeed":
        temporaries = 0  # fused AdamW
    else:
        temporaries = (2 * largest * 4) if layout.device_type == "cpu" else trainable * 4
    return {"params": params * pb, "grads": grads, "optimizer": optimizer, "buckets": buckets,
            "optimizer_temporaries": temporaries}


def _persistent_grads(grads: float, layout: Layout) -> float:
    """Gradients alive through the forward (DDP, DeepSpeed): DDP's buckets (dp > 1), ZeRO's
    partitions, or those accumulated over micro-batches."""
    persistent = grads if (layout.grad_accum > 1 or layout.engine == "deepspeed" or layout.dp > 1) else 0
    if layout.engine == "ddp" and layout.dp > 1 and layout.grad_accum > 1:
        # Under no_sync the micro-batches before the last accumulate into their own .grad tensors,
        # beside DDP's buckets (which the last one's gradients are views of): both are alive.
        persistent += grads
    return persistent


def _kind(model: nn.Module) -> Optional[str]:
    """The one place the kinds of model the planner knows are told apart: the reference GPT
    (`bigdense.models.GPT`), a Hugging Face causal LM (a `CausalLM`, or the transformers model), or None."""
    if isinstance(model, GPT):
        return "gpt"
    return "hf" if is_causal_lm(model) else None


def model_shape(model: nn.Module, seq_len: int):
    """The sizes of a known model (`GPTShape`, `HFShape`: ``d_model``, ``n_layers``, ``seq_len``, ...), else None."""
    kind = _kind(model)
    if kind == "gpt":
        return GPTShape.from_model(model, seq_len)
    return HFShape.from_config((model.lm if isinstance(model, CausalLM) else model).config, seq_len) if kind else None


@dataclass(frozen=True)
class Adapter:
    """A low-rank adapter of one layer as the estimate reads it (`bigdense.layers.lora`): the
    layer's name, its rank, its input dropout, and whether it is split over TP at the planned size
    (then the adapter adds one collective of tokens x r per micro-batch)."""

    layer: str
    r: int
    dropout: float
    split: bool


def adapters(model: nn.Module, entries, tp: int) -> list[Adapter]:
    """The adapters of ``model`` (whose parameters are ``entries``, `param_entries` at ``tp``)."""
    split = {e.name for e in entries if e.split_dim is not None and tp > 1}
    names = {id(m): n for n, m in model.named_modules()}  # as `entries` name them
    out = []
    for module in model.modules():
        settings = lora_settings(module)
        if settings is not None:
            name = names[id(module)]
            factors = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
            out.append(Adapter(name, settings.r, settings.dropout, any(f in split for f in factors)))
    return out


def tp_collective_bytes(shape, layout: Layout, adapters_: list[Adapter] = ()) -> float:
    """Bytes of the tensors one rank's TP collectives carry in a step (each ring moves ``2 (tp - 1) / tp``
    of it): the residual stream, 4 per block per micro-batch plus recompute's forward repeats, and
    the embedding's and head's 2; each split adapter's (tokens, r) per micro-batch (its recompute
    repeat not counted); at the compute width. Under sequence parallelism the all-gathers and
    reduce-scatters carry the same."""
    if layout.tp == 1:
        return 0.0
    tokens = layout.micro_batch_size * shape.seq_len
    per_block = 4 + {"none": 0, "mlp": 1, "full": 2, "every_k": 2 / layout.recompute_every}[layout.recompute]
    stream = (per_block * shape.n_layers + 2) * tokens * shape.d_model
    low_rank = sum(tokens * a.r for a in adapters_ if a.split)
    return (stream + low_rank) * layout.compute_bytes * layout.grad_accum


def activation_model(model: nn.Module, seq_len: Optional[int], layout: Layout, entries) -> Optional[object]:
    """The activation model of ``model``'s kind: `GPTMemory`, `HFMemory` (``model=hf``), or None
    (parameters, gradients and optimizer state only). Each answers ``moments``, ``categories``,
    ``per_layer``, ``flops_per_micro_batch`` and ``loss_in_head`` (the loss runs inside the output
    head's forward). ``entries``: ``model``'s `param_entries`."""
    kind = _kind(model) if seq_len else None
    if kind == "gpt":
        return GPTMemory(model_shape(model, seq_len), layout, GPTAdapters.of(model, entries, layout.tp))
    return HFMemory.of(model, seq_len, layout, entries) if kind == "hf" else None


def estimate(
    model: nn.Module,
    plan: Optional[Mapping] = None,
    *,
    tp: int = 1,
    dp: int = 1,
    layout: Optional[Layout] = None,
    seq_len: Optional[int] = None,
    overhead_gb: float = 0.0,
    muon: Optional[MuonSettings] = None,
    **layout_options,
) -> Estimate:
    """Parameters and memory per rank of ``model`` trained under a layout.

    ``model``: any ``nn.Module`` (on the meta device or not); its bigdense layers count as
    declared, and plain ``nn.Linear``/``nn.Embedding`` layers as ``bd.parallelize(model, plan)``
    would shard them (``plan=None``: its automatic plan, for a model without bigdense layers).
    ``tp``/``dp`` and ``layout_options`` (the fields of `Layout`: ``precision``, ``engine``,
    ``zero_stage``, ``dp_replicate``, ``reshard_after_forward``, ``micro_batch_size``, ``grad_accum``,
    ``recompute``, ``sequence_parallel``, ``device_type``) describe the step, or pass a whole ``layout``.
    With ``seq_len``, for the reference GPT (`bigdense.models.GPT`) and for a Hugging Face causal LM
    (a `CausalLM`, or the transformers model itself, counted by its own plan) the activations, the
    loss's working set and the FLOPs are estimated too (`activation_model`); for other modules only
    parameters, gradients and optimizer state (FSDP: also the end of the backward). ``muon``
    (``optim.name=muon``'s settings): Muon's momentum for the dense weights instead of AdamW's
    moments, its step's transient in the optimizer moment, and its exchange (`Estimate.muon`).
    """
    layout = layout or Layout(tp=tp, dp=dp, **layout_options)
    entries = param_entries(model, plan, layout.tp)
    per_rank = count_per_rank(entries, layout.tp)
    trainable = max(count_per_rank(entries, layout.tp, trainable_only=True))
    largest = max((e.local_numel(layout.tp, 0) for e in entries if e.trainable), default=0)
    params = max(per_rank)
    memory = activation_model(model, seq_len, layout, entries)
    in_head = memory is not None and memory.loss_in_head  # FSDP keeps the head's unit gathered through the loss
    fsdp = FSDPMemory(fsdp_units(model, entries, layout), layout, loss_in_head=in_head) \
        if layout.engine == "fsdp" else None
    states = fsdp.state_bytes() if fsdp else _state_bytes(params, trainable, largest, layout)
    if not fsdp:  # a frozen base held narrower (lora.base_dtype) counts at its own width
        states["params"] = max(bytes_per_rank(entries, layout.tp, layout.param_bytes))
    muon_plan = plan_muon(model, entries, layout, muon) if muon is not None else None
    if muon_plan is not None:  # the largest rank's state; the busiest rank's transient
        states["optimizer"] = muon_plan.busiest("state_bytes")
        states["optimizer_temporaries"] = muon_plan.busiest("step_bytes")
    cats = {k: states[k] for k in ("params", "grads", "optimizer")}
    est = Estimate(layout, sum(e.numel for e in entries), fsdp.shard_numel() if fsdp else params, cats,
                   trainable_params=sum(e.numel for e in entries if e.trainable),
                   trainable_per_rank=fsdp.trainable_shard_numel() if fsdp else trainable,
                   overhead_bytes=int(overhead_gb * GiB), muon=muon_plan)

    base = states["params"] + states["optimizer"] + states["buckets"]
    if fsdp is not None:
        est.phases = fsdp.moments(memory, base, states["optimizer_temporaries"])
    elif memory is None:
        est.phases = {"optimizer": base + states["grads"] + states["optimizer_temporaries"]}
    else:
        est.phases = memory.moments(base, _persistent_grads(states["grads"], layout), states["grads"],
                                    states["optimizer_temporaries"])
    cats["comm_buffers"] = states["buckets"]
    if memory is not None:
        cats.update(memory.categories())
        cats["comm_buffers"] = states["buckets"] + cats.pop("comm_buffers")  # after the activations, as printed
        est.activations_per_layer = [(n, int(b)) for n, b in memory.per_layer()]
        est.flops_per_step = memory.flops_per_micro_batch() * layout.grad_accum
        est.tp_collective_bytes = tp_collective_bytes(model_shape(model, seq_len), layout, adapters(model, entries, layout.tp))
    if fsdp is not None:
        cats["fsdp_gathered"] = fsdp.gathered_peak()
    cats["overhead"] = est.overhead_bytes
    est.bytes_per_rank = {k: int(v) for k, v in cats.items()}
    est.peak_phase, peak = max(est.phases.items(), key=lambda kv: kv[1])
    est.peak_bytes = int(peak)
    est.phases = {k: int(v) for k, v in est.phases.items()}
    return est
