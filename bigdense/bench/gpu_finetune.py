"""`bigdense.bench.gpu`'s fine-tuning case: one optimizer step of a Hugging Face Llama with a
128,256-token vocabulary, its loss through bigdense's fused head against transformers' own loss,
Liger-Kernel and Cut Cross-Entropy.

    python -m bigdense.bench.gpu --finetune --json gpu.jsonl    # this case only

The model (`MODELS`): ``llama_1b``, a transformers ``LlamaForCausalLM`` built from a ``LlamaConfig``
with Llama 3.2 1B's shape -- hidden 2048, 16 layers, 32 heads with 8 key/value heads (head dim 64),
intermediate 8192 (SwiGLU), vocabulary 128,256, the output head tied to the input embeddings, RMSNorm
eps 1e-5, rope theta 500,000 with Llama 3's frequency scaling -- 1,235,814,400 parameters (the tied
matrix once), random weights, SDPA attention, nothing downloaded. The batch: 4 x 2048 tokens of
random ids, the targets the next tokens (each row's last ignored, as transformers' own shift of
``labels`` leaves it). 4 x 2048 (8,192 tokens) fits every contender on one 80 GB H100 with room:
the fp32 weights, their gradients and AdamW's two moments take 20 GB, their bf16 copies under
autocast 2.5 GB, the decoder's saved activations about 18 GB (about 135 KB a token and layer,
counted on a CPU), and transformers' own loss adds about 15 GB of logits-sized tensors (the bf16
logits, their fp32 copy, its log-softmax and their gradients): about 55 GB. At 8 x 2048 that
contender would need about 90 GB.

Every contender runs one optimizer step as the DDP engine does (bf16 autocast with fp32 master
weights, torch's fused AdamW with the same hyper-parameters and weight-decay groups, gradient
clipping), on the same weights (one seed) and the same batch:

* ``bigdense`` ``eager`` and ``model``: `bigdense.models.CausalLM` of the model (its loss through
  bigdense's fused vocab-parallel cross-entropy from the hidden states the output head is given,
  decided and proved by ``prepare_loss``: the row's ``loss_path``) through the DDP engine at tp=1;
  ``model`` with the forward compiled whole (``trainer.compile=model``: `compile_model`);
* ``transformers``: the model's own loss (``model(input_ids=x, labels=x).loss``: its logits,
  upcast to fp32, and ``F.cross_entropy``), trained by `bigdense.bench.gpu_peer.twin_step`;
* ``liger_flce``: the model patched by ``liger_kernel.transformers.apply_liger_kernel_to_llama``
  with only its fused linear cross-entropy (the decoder as transformers': only the head differs),
  then its own loss with ``labels``; ``liger_defaults``: the patch's defaults, which also swap
  RoPE, RMSNorm and SwiGLU for Liger's kernels (what a Liger user gets);
* ``cce``: Cut Cross-Entropy's ``linear_cross_entropy`` (its default implementation) on the
  decoder's last hidden states and the head's weight, cast to bf16 as autocast casts a matmul's
  operands (its kernels take their inputs as given); its PyPI release has no transformers patch.

A peer that is not installed (the ``gpu-peers`` extra installs both) is skipped, saying so, and so
is every peer on a CPU (their Triton kernels need CUDA). Liger's patch also replaces globals of
transformers' Llama module for the whole process: they are put back after its row
(`_module_restored`). Each contender is measured as the GPT cases are
(`bigdense.bench.gpu_profile.measure`). Rows: ``case`` "finetune", ``model``, ``contender``,
``mode``, ``compiled``, ``params``, ``precision``, ``batch``, ``seq``, ``step_ms``,
``tokens_per_s``, ``mfu``, ``peak_mem_gb``, ``gpu_busy``, ``gpu_kernel_ms``, ``loss`` (the last
timed step's), ``first_loss`` (the first step's, on the initial weights: the same for every
contender up to rounding), the graph counts when compiled, ``loss_path`` for bigdense and, on a
peer's row, ``ratio_vs_bigdense`` (its step ms / bigdense eager's) and ``peak_ratio_vs_bigdense``
(its peak / bigdense eager's); a contender that failed or was skipped has ``error``.

Without CUDA, `bigdense.bench.gpu`'s smoke test runs the same code on model ``smoke`` (tiny
shapes, fp32, compiled with aot_eager, the peers skipped); there bigdense's first loss equals
transformers' (`tests/test_bench_gpu.py`).
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback
from typing import Callable, Optional, Sequence

import torch

MODELS = {
    "llama_1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, batch=4, seq=2048),
    "smoke": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=32),
}
# (contender, mode) in the order they run: the comparisons first, the compiled mode last, so that
# a spent budget skips compilation rather than a peer.
CONTENDERS = (("bigdense", "eager"), ("transformers", "eager"), ("liger_flce", "eager"), ("cce", "eager"),
              ("liger_defaults", "eager"), ("bigdense", "model"))
# A contender's module, and the package that installs it.
NEEDS = {"bigdense": ("transformers", "transformers"), "transformers": ("transformers", "transformers"),
         "liger_flce": ("liger_kernel.transformers", "liger-kernel"),
         "liger_defaults": ("liger_kernel.transformers", "liger-kernel"),
         "cce": ("cut_cross_entropy", "cut-cross-entropy")}
PEERS = ("liger_flce", "liger_defaults", "cce")  # Triton kernels
IGNORE = -100


def llama_config(spec: dict):
    """The ``LlamaConfig`` of ``spec`` (`MODELS`): Llama 3.2 1B's choices at ``spec``'s shape."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        head_dim=spec["hidden"] // spec["heads"], max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8192),
        attn_implementation="sdpa", use_cache=False,  # training keeps no KV cache
    )


def build_llama(spec: dict, device: torch.device) -> torch.nn.Module:
    """``LlamaForCausalLM`` of `llama_config`, fp32, on ``device``, in training mode; its weights are
    drawn from the seed, so every contender gets the same ones."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: no host copy of a 1B model to move
        return LlamaForCausalLM(llama_config(spec)).train()


def batch(spec: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: (batch, seq) token ids and their next tokens, each row's last target ignored --
    what transformers makes of ``labels=x``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)
    return x.to(device), next_tokens(x).to(device)


def next_tokens(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE)], dim=1)


def unavailable(contender: str, device: torch.device) -> Optional[str]:
    """Why ``contender`` cannot run here (it is then skipped), or None."""
    import importlib

    module, package = NEEDS[contender]
    extra = " (the gpu-peers extra installs it)" if contender in PEERS else ""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return f"{package} is not installed{extra}"
    except Exception as exc:  # noqa: BLE001 - any import failure means no contender
        return f"{module} does not import ({type(exc).__name__}: {exc})"
    if contender in PEERS and device.type != "cuda":
        return "its Triton kernels need CUDA"  # Triton's interpreter lacks what some of them use (inline asm)
    return None


def _bigdense_step(spec: dict, mode: str, device: torch.device, ctx, precision: str, backend: str):
    """bigdense's `CausalLM` through the DDP engine; (step, parameters, extra row fields)."""
    from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
    from bigdense.models import CausalLM
    from bigdense.train.compile import compile_model
    from bigdense.train.engines import EngineSettings, build_engine

    model = CausalLM(build_llama(spec, device))
    path = model.prepare_loss()  # on the real weights, before compiling (as the fine-tune job orders them)
    if mode == "model":
        compile_model(model, backend)
    settings = EngineSettings(engine=EngineConfig(), optim=OptimConfig(warmup_steps=10),
                              precision=PrecisionConfig(dtype=precision), micro_batch_size=spec["batch"],
                              max_steps=10**6)
    engine = build_engine(model, ctx, settings)
    micro_batches = [batch(spec, device)]
    return (lambda: engine.train_step(micro_batches).raw["loss"]), model.num_parameters()["total"], \
        dict(loss_path=path.describe())


def _peer_step(spec: dict, contender: str, device: torch.device, precision: str):
    """A peer: the model (patched for Liger), trained by `gpu_peer.twin_step`; (step, parameters,
    extra row fields)."""
    from bigdense.config import OptimConfig

    from .gpu_peer import twin_step

    model = build_llama(spec, device)
    loss_of = None  # the model's own loss with labels
    if contender.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        only_head = dict(rope=False, rms_norm=False, swiglu=False) if contender == "liger_flce" else {}
        apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, model=model, **only_head)
    elif contender == "cce":
        loss_of = _cce_loss(precision)
    x, _ = batch(spec, device)
    step = twin_step(model, OptimConfig(warmup_steps=10), x, precision=precision, compiled=False, loss_of=loss_of)
    return step, sum(p.numel() for p in model.parameters()), {}


def _cce_loss(precision: str) -> Callable:
    """Cut Cross-Entropy's loss of a Llama on ``input_ids``, as its README applies it: the decoder's
    last hidden states and the head's weight into ``linear_cross_entropy``."""
    from cut_cross_entropy import linear_cross_entropy

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def loss_of(model, input_ids):
        h = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return linear_cross_entropy(h.to(dtype), model.lm_head.weight.to(dtype), next_tokens(input_ids))

    return loss_of


def _measure(contender: str, mode: str, spec: dict, device: torch.device, ctx, sched, precision: str,
             warmup_steps: Callable[[str, int], int]) -> dict:
    import bigdense as bd

    from .gpu_profile import measure

    if contender == "bigdense":
        step, n_params, extra = _bigdense_step(spec, mode, device, ctx, precision, sched.backend)
    else:
        step, n_params, extra = _peer_step(spec, contender, device, precision)
    first = []

    def kept_first() -> torch.Tensor:  # the loss on the initial weights: equal for every contender
        loss = step()
        if not first:
            first.append(loss.detach().clone())  # an engine may hand back the same buffer each step
        return loss

    compiled = mode != "eager"
    with bd.set_checks(False):  # the training loop's hot path: no host-side reads of the device
        measured = measure(kept_first, warmup=warmup_steps(mode, sched.warmup), steps=sched.steps,
                           busy_steps=sched.busy_steps, device=device, count_graphs=compiled)
    return dict(_row(contender, mode, spec, device, precision, measured, n_params), first_loss=float(first[0]),
                **extra)


def _row(contender: str, mode: str, spec: dict, device: torch.device, precision: str, measured: dict,
         n_params: int) -> dict:
    from bigdense.train.flops import flops_per_token, mfu, peak_tflops

    measured = dict(measured)
    step_s = measured.pop("step_s")
    tokens_per_s = spec["batch"] * spec["seq"] / step_s
    flops_token = flops_per_token(n_params, spec["layers"], spec["hidden"], spec["seq"])
    return dict(_labels(contender, mode, spec), params=n_params, precision=precision, batch=spec["batch"],
                seq=spec["seq"], step_ms=step_s * 1e3, tokens_per_s=tokens_per_s,
                mfu=mfu(tokens_per_s, flops_token, peak_tflops(device)), **measured,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


def _labels(contender: str, mode: str, spec: dict) -> dict:
    return dict(bench="gpu", case="finetune", model=spec["name"], contender=contender, mode=mode,
                compiled=mode != "eager")


def run(ctx, model: str, device: torch.device, sched, *, precision: str, warmup_steps: Callable[[str, int], int],
        release: Callable[[torch.device], None], deadline: float = math.inf,
        contenders: Sequence[tuple[str, str]] = CONTENDERS) -> list[dict]:
    """Each of ``contenders`` (`CONTENDERS`) on ``model`` (`MODELS`), measured with ``sched``'s steps,
    profiled steps and compile backend, ``warmup_steps(mode, sched.warmup)`` untimed steps first;
    ``release(device)`` after each; none started after ``deadline`` (``time.time()``). Rows with
    the peers' ratios (`add_ratios`)."""
    spec, rows = dict(MODELS[model], name=model), []
    for contender, mode in contenders:
        why = unavailable(contender, device)
        if why is None and time.time() > deadline:
            why = "time budget"
        if why is not None:
            rows.append(dict(_labels(contender, mode, spec), error=f"skipped: {why}"))
            continue
        try:
            with _module_restored("transformers.models.llama.modeling_llama"):
                rows.append(_measure(contender, mode, spec, device, ctx, sched, precision, warmup_steps))
        except Exception:  # noqa: BLE001 - one failed contender must not hide the others
            rows.append(dict(_labels(contender, mode, spec), error=traceback.format_exc(limit=3)))
        finally:
            release(device)
    add_ratios(rows)
    return rows


@contextlib.contextmanager
def _module_restored(name: str):
    """Put back every global of module ``name`` a contender replaced (Liger's patch swaps the Llama
    module's RoPE function, RMSNorm and MLP classes for every model built after it)."""
    import importlib

    module = importlib.import_module(name)
    saved = dict(vars(module))
    try:
        yield
    finally:
        for key in [k for k in vars(module) if k not in saved]:
            delattr(module, key)
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


def add_ratios(rows: list[dict]) -> None:
    """``ratio_vs_bigdense`` (step ms) and ``peak_ratio_vs_bigdense`` (peak memory; None on a CPU)
    of every measured peer row against bigdense eager's, where both were measured."""
    ours = next((r for r in rows if r.get("case") == "finetune" and r["contender"] == "bigdense"
                 and r["mode"] == "eager" and "error" not in r), None)
    if ours is None:
        return
    for row in rows:
        if row.get("case") == "finetune" and row["contender"] != "bigdense" and "error" not in row:
            both = ours["peak_mem_gb"] is not None and row["peak_mem_gb"] is not None
            peak = row["peak_mem_gb"] / ours["peak_mem_gb"] if both else None
            row.update(ratio_vs_bigdense=row["step_ms"] / ours["step_ms"], peak_ratio_vs_bigdense=peak)


def print_table(rows: list[dict]) -> None:
    """The fine-tuning rows as a table, then the peers' ratios against bigdense eager."""
    if not rows:
        return
    measured = next((r for r in rows if "error" not in r), rows[0])
    shape = f"{measured['batch']} x {measured['seq']} tokens, {measured['params'] / 1e6:.1f}M parameters" \
        if "batch" in measured else ""
    print(f"fine-tuning step, {rows[0]['model']} (Llama, vocabulary {MODELS[rows[0]['model']]['vocab']:,}) {shape}")
    print(f"  {'contender':24s} {'step ms':>9s} {'tokens/s':>11s} {'MFU':>6s} {'peak GiB':>9s} {'first loss':>10s}  "
          "loss path")
    for r in rows:
        run = f"{r['contender']} {r['mode']}"
        if "error" in r:
            last = r["error"].strip().splitlines()[-1]
            print(f"  {run:24s} {last if last.startswith('skipped') else 'failed: ' + last}")
            continue
        util = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
        print(f"  {run:24s} {r['step_ms']:9.1f} {r['tokens_per_s']:11,.0f} {util:>6s} {peak:>9s} "
              f"{r['first_loss']:10.4f}  {r.get('loss_path', '-')}")
    peers = [r for r in rows if "ratio_vs_bigdense" in r]
    if peers:
        print("  peer / bigdense eager (above 1: bigdense is faster, or needs less memory):")
        for r in peers:
            peak = f"{r['peak_ratio_vs_bigdense']:.2f}" if r["peak_ratio_vs_bigdense"] is not None else "-"
            print(f"    {r['contender'] + ' ' + r['mode']:24s} time {r['ratio_vs_bigdense']:.2f}, peak {peak}")
