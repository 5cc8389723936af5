"""What the head costs on a GPU, judged on CPU: its GPU control flow traced on the ``meta`` device.

    python -m bigdense.bench.head --gpu-proxy [--json FILE]          # the three shapes below, tp=1
    python -m bigdense.bench.head --gpu-proxy --proxy-path off       # the CPU-shaped loop, for comparison

`ParallelClassifierHead.loss` forward + backward (bf16 weights and inputs, mean cross-entropy, no
bias) runs at full size on ``meta`` tensors, which hold no data: every aten op still dispatches, so
it is counted, and the Triton kernels are replaced by stubs that count their launches and the bytes
their contract says they move (`bigdense.kernels.softmax_ce`). Per shape:

* ``ops_per_chunk``: kernel-launching operations per chunk of tokens (views launch nothing),
  Triton launches included: the difference between a run of k chunks and one of k - 1, so what
  runs once per call is not in it;
* ``nongemm_bytes_per_logit``: bytes read and written by every operation other than a matrix
  multiplication, over the whole call, per logit (tokens x classes);
* ``peak_gib``: the allocation peak above what was allocated before the call, gradients included
  (storages are followed from their first op to their last reference).

A GPU's time is then about "three-GEMM floor + non-GEMM bytes / 2.4 TB/s" (it predicted the H200's
measured head times within 3%), and its peak the figure here.
"""
from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import asdict, dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHAPES = ((8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256))
aten = torch.ops.aten
_GEMMS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.baddbmm_, aten.matmul, aten.addmv,
          aten.addmv_, aten.mv}
_NO_LAUNCH = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CostCounter(TorchDispatchMode):
    """Kernel launches, non-GEMM bytes and the live-storage peak of what runs inside it."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.nongemm_bytes = 0
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage -> [bytes, live tensors]

    def launch(self, nbytes: int) -> None:
        """A kernel outside aten (a Triton launch) that moves ``nbytes``."""
        self.ops += 1
        self.nongemm_bytes += nbytes

    def _track(self, t: torch.Tensor, new: bool) -> None:
        """Follow ``t``'s storage: a ``new`` one (an op's own output) counts from now on; a view
        keeps an already followed storage alive (one from before the call is not followed)."""
        key = t.untyped_storage()._cdata
        entry = self._refs.get(key)
        if entry is None and not new:
            return
        if entry is None:
            entry = self._refs[key] = [t.untyped_storage().nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = list(_tensors(out))
        packet = func.overloadpacket
        is_view = func.is_view or torch.Tag.view_copy in func.tags
        for t in outputs:
            self._track(t, new=not is_view and not _writes_into(func, t, args, kwargs))
        if is_view or packet in _NO_LAUNCH:
            return out
        self.ops += 1
        if packet not in _GEMMS:
            inputs = [t for t in _tensors((args, kwargs)) if t.dim() > 0 or t.numel()]
            self.nongemm_bytes += sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        return out


def _writes_into(func, t: torch.Tensor, args, kwargs) -> bool:
    """Whether ``t`` is one of the op's own arguments (an in-place or ``out=`` op): no new storage."""
    return any(a is t or (a.untyped_storage()._cdata == t.untyped_storage()._cdata)
               for a in _tensors((args, kwargs)))


def _counting_kernels(counter: CostCounter):
    """`CEKernels` stubs: each call is one launch moving what its contract reads and writes."""
    from bigdense.kernels.softmax_ce import CEKernels

    def row_stats(z, target, offset, real, smoothing, out, softcap=0.0):  # a softcap is computed in registers
        counter.launch(_nbytes(z) + _nbytes(target) + _nbytes(out))
        return out

    def softmax_grad_(z, stats, target, offset, real, weight, eps, smooth, softcap=0.0, z_loss=0.0):
        counter.launch(2 * _nbytes(z) + _nbytes(stats) + _nbytes(target) + _nbytes(weight))
        return z

    return CEKernels("counted", row_stats, softmax_grad_)


@dataclass
class ProxyResult:
    tokens: int
    d: int
    classes: int
    path: str
    chunk_tokens: int
    chunks: int
    ops_per_chunk: int
    nongemm_bytes_per_logit: float
    peak_gib: float


def _one_call(tokens: int, d: int, classes: int, chunk: int | None, dtype) -> tuple[CostCounter, int]:
    import bigdense as bd
    from bigdense.layers.head import ce_gpu

    head = bd.ParallelClassifierHead(d, classes, bias=False, chunk_size=chunk, device="meta", dtype=dtype)
    h = torch.empty(tokens, d, device="meta", dtype=dtype, requires_grad=True)
    target = torch.empty(tokens, device="meta", dtype=torch.long)
    counter = CostCounter()
    with bd.set_checks(False), mock.patch.object(ce_gpu, "ce_kernels", lambda device: _counting_kernels(counter)):
        with counter:
            loss = head.loss(h, target)
            loss.backward()
            grads = (h.grad, head.weight.grad)
        del loss, grads
    return counter, head


def measure(tokens: int, d: int, classes: int, path: str = "kernels", dtype=torch.bfloat16) -> ProxyResult:
    """The proxy's figures for one shape at tp=1 (``path="off"``: the CPU-shaped loop on this device)."""
    import bigdense as bd
    from bigdense.kernels.softmax_ce import KERNELS_ENV
    from bigdense.layers.head.fused_ce import loss_chunk_tokens

    env = {KERNELS_ENV: "off"} if path == "off" else {}
    with mock.patch.dict("os.environ", env), contextlib.ExitStack():
        bd.set_default_context(None)
        chunk = loss_chunk_tokens(classes, "meta", dtype, 1)
        chunks = -(-tokens // chunk)
        full, _ = _one_call(tokens, d, classes, chunk, dtype)
        fewer, _ = _one_call(tokens - chunk, d, classes, chunk, dtype) if chunks > 1 else (full, None)
    per_chunk = full.ops - fewer.ops if chunks > 1 else full.ops
    return ProxyResult(tokens, d, classes, path, chunk, chunks, per_chunk,
                       round(full.nongemm_bytes / (tokens * classes), 2), round(full.peak / 2**30, 3))


def run(json_path: str | None = None, path: str = "kernels", shapes=SHAPES) -> list[ProxyResult]:
    results = []
    print(f"GPU proxy of ParallelClassifierHead.loss (bf16, mean, no bias, tp=1, meta device), path={path}")
    print(f"{'tokens x d -> classes':>28} {'chunk':>6} {'chunks':>6} {'ops/chunk':>9} {'non-GEMM B/logit':>16} "
          f"{'peak GiB':>9}")
    for tokens, d, classes in shapes:
        r = measure(tokens, d, classes, path)
        results.append(r)
        print(f"{f'{tokens:,} x {d:,} -> {classes:,}':>28} {r.chunk_tokens:>6} {r.chunks:>6} {r.ops_per_chunk:>9} "
              f"{r.nongemm_bytes_per_logit:>16.2f} {r.peak_gib:>9.3f}")
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
    return results
