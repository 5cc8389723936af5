"""What one dropout site costs a GPU: bigdense's layout-free dropout against ``F.dropout``.

    python -m bigdense.bench.dropout                  # gpt_small's sites, bf16, about 1 minute on 2 cores
    python -m bigdense.bench.dropout --json dropout.jsonl

Per dropout site of the GPU path's shapes (gpt_small, batch 8 x 1,024: the residual stream
(8, 1024, 768) and the attention probabilities (8, 12, 1024, 1024)), for `bd.tp_dropout` (its torch
ops, which CPUs and compiled graphs run; and its eager CUDA path, one Triton pass each way,
`kernels/triton_dropout.py`, counted with the launch replaced by a stub that counts its bytes) and
``F.dropout`` (torch's Philox mask, the baseline), forward then backward:

* **eager**: kernel-launching aten ops, bytes they read and write per element of the activation,
  and bytes saved for the backward per element; counted on the ``meta`` device at full size
  (`bench.head_proxy.CostCounter`: shapes only, nothing computed, so it runs in seconds);
* **compiled** (``torch.compile`` with inductor, as ``trainer.compile`` uses it, on CPU at a
  smaller shape: the kernels inductor generates do not depend on the size): kernels generated for
  the forward and for the backward (``torch._inductor.metrics``), ops inductor left to aten
  (``extern_calls``: the key's ``randint``, a ``bernoulli`` under ``fallback_random``), and bytes
  saved for the backward per element (caches off, so every graph is generated and counted).

A fused pass reads its input and writes its output once: 2 x the element size per pass. The ratio
printed is the baseline's over bigdense's, per measure.
"""
from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F

from . import append_json_lines

SITES = {"residual": (8, 1024, 768), "attention_probs": (8, 12, 1024, 1024)}
P = 0.1


TRITON = "bd.tp_dropout, eager CUDA (Triton)"


def _contenders():
    from bigdense.parallel.dropout import tp_dropout

    return {"F.dropout (baseline)": lambda x: F.dropout(x, P, training=True),
            "bd.tp_dropout": lambda x: tp_dropout(x, P, training=True),
            TRITON: lambda x: tp_dropout(x, P, training=True)}


@contextlib.contextmanager
def _triton_stub(counter_of):
    """The eager CUDA path on meta tensors: `triton_dropout`'s launch replaced by a stub that counts
    one launch reading and writing its contract's bytes (``counter_of()``: the active counter)."""
    import os

    from bigdense.kernels import counter_hash, triton_dropout

    def launch(x, row_word, col_word, threshold, scale):
        out = torch.empty_like(x)
        counter_of().launch(2 * x.numel() * x.element_size() + 4 * (row_word.numel() + col_word.numel()))
        return out

    saved, triton_dropout._launch = triton_dropout._launch, launch
    previous = os.environ.get(counter_hash.KERNELS_ENV)
    os.environ[counter_hash.KERNELS_ENV] = "triton"
    try:
        yield
    finally:
        triton_dropout._launch = saved
        if previous is None:
            del os.environ[counter_hash.KERNELS_ENV]
        else:
            os.environ[counter_hash.KERNELS_ENV] = previous


class _Saved:
    """Bytes autograd saves for the backward while it is active (``saved_tensors_hooks``)."""

    def __init__(self):
        self.nbytes = 0

    def __enter__(self):
        def pack(t):
            self.nbytes += t.numel() * t.element_size()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def eager_cost(fn, shape, dtype, triton: bool = False) -> dict:
    """Launches, non-GEMM bytes per element (forward, backward) and saved bytes per element of
    ``fn`` on a ``meta`` tensor of ``shape`` (``triton``: through the stubbed Triton path)."""
    from .head_proxy import CostCounter

    x = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    n = math.prod(shape)
    forward, backward = CostCounter(), CostCounter()
    active = [forward]
    with _triton_stub(lambda: active[0]) if triton else contextlib.nullcontext():
        with _Saved() as saved, forward:
            y = fn(x)
        grad = torch.empty_like(y)
        active[0] = backward
        with backward:
            y.backward(grad)
    return dict(ops_forward=forward.ops, ops_backward=backward.ops, bytes_per_element_forward=forward.nongemm_bytes / n,
                bytes_per_element_backward=backward.nongemm_bytes / n, saved_bytes_per_element=saved.nbytes / n)


def compiled_cost(fn, shape, dtype) -> dict:
    """Kernels inductor generates for ``fn``'s forward and backward, the aten ops it leaves
    (extern calls), and the bytes saved for the backward per element, on CPU."""
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics
    from torch._dynamo.utils import counters

    from bigdense.train.compile_counts import backend_for, no_compile_caches

    inductor_config.fallback_random = True  # as trainer.compile sets it: eager's masks
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend_for("inductor"), fullgraph=True)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = {}
    with no_compile_caches():
        _count_phases(compiled, x, out)
    return out


def _count_phases(compiled, x, out: dict) -> None:
    import torch._inductor.metrics as metrics
    from torch._dynamo.utils import counters

    for phase in ("forward", "backward"):
        metrics.reset()
        externs = counters["inductor"]["extern_calls"]
        if phase == "forward":
            with _Saved() as saved:
                y = compiled(x)
            out["saved_bytes_per_element_compiled"] = saved.nbytes / x.numel()
        else:
            y.backward(torch.ones_like(y))
        out[f"kernels_{phase}"] = metrics.generated_kernel_count
        out[f"extern_calls_{phase}"] = counters["inductor"]["extern_calls"] - externs


def run(dtype=torch.bfloat16, compiled_shape=(4, 64, 96)) -> list[dict]:
    results = []
    for site, shape in SITES.items():
        for name, fn in _contenders().items():
            row = dict(bench="dropout", site=site, shape=list(shape), dtype=str(dtype).replace("torch.", ""),
                       contender=name, p=P)
            row.update(eager_cost(fn, shape, dtype, triton=name == TRITON))
            # Compiled, the Triton contender is the torch ops again (inductor fuses them): not re-measured.
            row.update(compiled_cost(fn, compiled_shape, dtype) if name != TRITON else
                       {k: v for k, v in results[-1].items() if "kernels" in k or "extern" in k or "compiled" in k})
            results.append(row)
    return results


def _print(results: list[dict]) -> None:
    keys = ("ops_forward", "ops_backward", "bytes_per_element_forward", "bytes_per_element_backward",
            "saved_bytes_per_element", "kernels_forward", "kernels_backward", "extern_calls_forward",
            "saved_bytes_per_element_compiled")
    for site in SITES:
        rows = [r for r in results if r["site"] == site]
        print(f"{site} {tuple(rows[0]['shape'])}, {rows[0]['dtype']}, p={P}: eager on meta (ops, bytes per element), "
              f"compiled with inductor (kernels, aten ops left)")
        print(f"  {'':36s}" + "".join(f"{k:>14s}" for k in ("eager ops f/b", "bytes/el f/b", "saved B/el",
                                                               "kernels f/b", "extern f", "saved B/el")))
        for r in rows:
            print(f"  {r['contender']:36s}{r['ops_forward']:>9d}/{r['ops_backward']:<4d}"
                  f"{r['bytes_per_element_forward']:>9.1f}/{r['bytes_per_element_backward']:<4.1f}"
                  f"{r['saved_bytes_per_element']:>12.2f}  {r['kernels_forward']:>9d}/{r['kernels_backward']:<4d}"
                  f"{r['extern_calls_forward']:>9d}{r['saved_bytes_per_element_compiled']:>14.4f}")
        base = rows[0]
        for ours in rows[1:]:
            ratios = {k: base[k] / ours[k] for k in keys if ours[k]}
            print(f"  ratio baseline / {ours['contender']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--json", help="append one JSON object per result to this file")
    args = parser.parse_args(argv)
    results = run(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    _print(results)
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    main()
