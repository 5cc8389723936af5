"""The peer of `bigdense.bench.gpu`'s GPT cases: the Hugging Face GPT-2 of the same shape, trained
the way the bigdense DDP engine trains.

`build_twin` makes a ``transformers`` ``GPT2LMHeadModel`` from a ``GPT2Config`` (never downloaded):
the bigdense case's width, layers, heads, vocabulary and sequence length (``n_positions``), its
dropout on embeddings and residual branches, its attention-probability dropout, exact GELU, layer
norm eps 1e-5, biases, tied embeddings, SDPA attention -- the same parameter count as the bigdense
GPT. `twin_step` trains it as `bigdense.train.engines.DDPEngine` does: fp32 master weights, bf16
autocast on the forward (fp32 on a CPU), torch's fused AdamW with the same hyper-parameters and
weight-decay groups (`param_groups`: decay on matrices only), ``clip_grad_norm_`` (foreach) at
``optim.grad_clip``, eager or with the whole model under ``torch.compile``. The loss is the
model's own (``labels=input_ids``; transformers shifts them), or what ``loss_of`` computes (the
fine-tuning case's Cut Cross-Entropy peer, `bigdense.bench.gpu_finetune`).

`add_ratios` puts ``ratio_vs_bigdense`` (peer step ms / bigdense step ms) on the peer rows: eager
against bigdense eager, compiled against bigdense's fastest compiled mode.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

PEER = "hf_gpt2"


def available() -> Optional[str]:
    """None when ``transformers`` imports, else why not (the peer is then skipped)."""
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no peer
        return f"transformers is not importable ({type(exc).__name__}: {exc})"
    return None


def twin_config(spec: dict, dropout: float, attention_dropout: float):
    """The ``GPT2Config`` of a bigdense GPT of shape ``spec`` (`bigdense.bench.gpu.MODELS`)."""
    from transformers import GPT2Config

    last_token = spec["vocab_size"] - 1  # GPT-2's 50256 may lie outside a small vocabulary
    return GPT2Config(
        vocab_size=spec["vocab_size"], n_positions=spec["seq"], n_embd=spec["d_model"], n_layer=spec["n_layers"],
        n_head=spec["n_heads"], activation_function="gelu",  # bigdense's MLP: exact GELU (GPT-2's own: tanh)
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=attention_dropout, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False,  # training keeps no KV cache
        bos_token_id=last_token, eos_token_id=last_token,
    )


def build_twin(spec: dict, dropout: float, attention_dropout: float, device: torch.device) -> torch.nn.Module:
    """``GPT2LMHeadModel`` of ``twin_config``, fp32, on ``device``, in training mode."""
    from transformers import GPT2LMHeadModel

    with torch.device(device):  # built where it trains: no host copy of a 1B model to move
        model = GPT2LMHeadModel(twin_config(spec, dropout, attention_dropout))
    model.loss_type = "ForCausalLM"  # what transformers falls back to for GPT-2 anyway, without its warning
    return model.train()


def twin_step(model: torch.nn.Module, optim, input_ids: torch.Tensor, *, precision: str, compiled: bool,
              backend: str = "inductor",
              loss_of: Optional[Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = None,
              ) -> Callable[[], torch.Tensor]:
    """One training step of ``model`` on ``input_ids`` (see the module docstring); returns the
    step as a function returning the loss (a detached tensor: nothing is read on the host).
    ``loss_of(model, input_ids)``: the loss, in place of the model's own with ``labels``."""
    from bigdense.train.compile_counts import backend_for
    from bigdense.train.engines.base import param_groups

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=float(optim.lr),
                                  betas=tuple(float(b) for b in optim.betas), eps=float(optim.eps), fused=True)
    # bigdense's compiles use the same backend (`backend_for`: torch's, wrapped to count its graphs).
    forward = torch.compile(model, backend=backend_for(backend)) if compiled else model
    device_type = input_ids.device.type
    grad_clip = float(optim.grad_clip)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if loss_of is None:
                loss = forward(input_ids=input_ids, labels=input_ids).loss
            else:
                loss = loss_of(forward, input_ids)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        optimizer.step()
        return loss.detach()

    return step


def compile_defaults(backend: str):
    """The context a compiled peer compiles in: torch's defaults. `bigdense.train.compile` sets
    inductor's ``fallback_random`` (process-wide) so compiled dropout draws eager's keys; a Hugging
    Face user compiles without it, with dropout's random numbers generated inside inductor's
    fused kernels."""
    if backend != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=False)


def add_ratios(rows: list[dict]) -> None:
    """Set ``ratio_vs_bigdense`` and ``vs_mode`` on every peer row that has a bigdense row to
    compare with (same model, tp = 1): eager against ``eager``, compiled against the bigdense
    compiled mode with the shortest step."""
    for peer in rows:
        if peer.get("case") != "gpt_peer" or "error" in peer:
            continue
        ours = [r for r in rows if r.get("case") == "gpt" and r.get("model") == peer["model"] and r.get("tp") == 1
                and "error" not in r and (r["mode"] != "eager") == peer["compiled"]]
        if ours:
            best = min(ours, key=lambda r: r["step_ms"])
            peer.update(ratio_vs_bigdense=peer["step_ms"] / best["step_ms"], vs_mode=best["mode"])
