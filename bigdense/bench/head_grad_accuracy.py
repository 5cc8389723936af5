"""How exact the head's GPU path is in bf16: loss and gradients against a float64 reference.

    python -m bigdense.bench.head --grad-accuracy [--classes 2048] [--json FILE]    # ~5 minutes on 2 cores

For each of the three LLM shapes of docs/performance.md, bf16 weights and inputs, mean
cross-entropy: the GPU loop (`layers/head/ce_gpu.py`, run with the kernels' torch references on CPU)
with the weight gradient in bf16 (the default) and accumulated in fp32 (``fp32_weight_grad``),
against autograd through ``F.cross_entropy`` in float64 on the same bf16 values. The tokens, the
width and the chunk size (hence the number of bf16 accumulations of each weight-gradient entry) are
the shape's; the classes are ``--classes`` so that float64 runs on a CPU. Printed: relative errors
(Frobenius) of the loss, ``grad_h`` and ``grad_W``, and the bf16 rounding of the exact ``grad_W``,
the least any bf16 gradient can have.
"""
from __future__ import annotations

import json
from unittest import mock

import torch
import torch.nn.functional as F

from .head_proxy import SHAPES


def _rel(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact).norm() / exact.norm())


def measure(tokens: int, d: int, true_classes: int, classes: int) -> dict:
    import bigdense as bd
    from bigdense.kernels.softmax_ce import KERNELS_ENV
    from bigdense.layers.head.fused_ce import loss_chunk_tokens

    chunk = loss_chunk_tokens(true_classes, "cuda", torch.bfloat16, 1)
    g = torch.Generator().manual_seed(0)
    # Logits of a few units (not a flat softmax): weights 4x nn.Linear's scale.
    weight = (torch.randn(classes, d, generator=g) * 4 * d**-0.5).to(torch.bfloat16)
    h = torch.randn(tokens, d, generator=g).to(torch.bfloat16)
    target = torch.randint(0, classes, (tokens,), generator=g)
    w64, h64 = weight.double().requires_grad_(), h.double().requires_grad_()
    exact_loss = F.cross_entropy(h64 @ w64.t(), target)
    exact_loss.backward()
    exact = float(exact_loss.detach())
    row = dict(tokens=tokens, d=d, classes=true_classes, measured_classes=classes, chunk=chunk,
               chunks=-(-tokens // chunk), bf16_rounding_grad_w=_rel(w64.grad.bfloat16(), w64.grad))
    for fp32 in (False, True):
        head = bd.ParallelClassifierHead(d, classes, bias=False, chunk_size=chunk, fp32_weight_grad=fp32,
                                         dtype=torch.bfloat16)
        with torch.no_grad():
            head.weight.copy_(weight)
        hh = h.clone().requires_grad_()
        with bd.set_checks(False), mock.patch.dict("os.environ", {KERNELS_ENV: "torch"}):
            loss = head.loss(hh, target)
            loss.backward()
        key = "fp32" if fp32 else "bf16"
        row[f"{key}_loss"] = abs(float(loss.detach()) - exact) / abs(exact)
        row[f"{key}_grad_h"] = _rel(hh.grad, h64.grad)
        row[f"{key}_grad_w"] = _rel(head.weight.grad, w64.grad)
    return row


def run(classes: int = 2048, json_path: str | None = None, shapes=SHAPES) -> list[dict]:
    import bigdense as bd

    bd.set_default_context(None)
    print(f"bf16 GPU loop vs float64 (relative errors; classes reduced to {classes:,}, chunks as on the GPU)")
    print(f"{'tokens x d -> classes':>28} {'chunks':>9} {'loss':>8} {'grad_h':>8} {'grad_W bf16':>11} "
          f"{'grad_W fp32':>11} {'bf16 floor':>10}")
    rows = []
    for tokens, d, true_classes in shapes:
        r = measure(tokens, d, true_classes, classes)
        rows.append(r)
        shape = f"{tokens:,} x {d:,} -> {true_classes:,}"
        print(f"{shape:>28} {r['chunks']:>3} of {r['chunk']:<3} {r['bf16_loss']:8.1e} {r['bf16_grad_h']:8.1e} "
              f"{r['bf16_grad_w']:11.1e} {r['fp32_grad_w']:11.1e} {r['bf16_rounding_grad_w']:10.1e}", flush=True)
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps(r) + "\n")
    return rows
