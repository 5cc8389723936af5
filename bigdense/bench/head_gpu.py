"""The fused linear + cross-entropy on one GPU against its peers, at three LLM shapes.

    python -m bigdense.bench.gpu --peers [--profile] [--json FILE]     # about 2 minutes on an H200

bf16 weights and inputs, forward + backward of linear + mean cross-entropy, the same inputs for every
contender; median of ``--head-iters`` calls after 3 warm-ups; peak = the most memory allocated
during the calls above what was allocated before them; the floor is the three GEMMs
(6 x tokens x d x classes FLOPs) at the bf16 GEMM rate an 8192^3 matmul reaches in the same run.

* ``torch``: ``F.linear``, ``.float()``, ``F.cross_entropy`` (the full logits);
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, when importable;
* ``cce``: Cut Cross-Entropy's ``linear_cross_entropy``, when importable;
* ``bigdense``: ``ParallelClassifierHead.loss`` (tp=1; its GPU path, `layers/head/ce_gpu.py`).

The ``gpu-peers`` extra installs the two peers. ``--profile`` prints the top kernels of one
bigdense call (``torch.profiler``).
"""
from __future__ import annotations

import torch

SHAPES = ((8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256))


def gemm_tflops(device, n: int = 8192, iters: int = 10) -> float:
    """The bf16 rate of a plain n^3 matmul on ``device``, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def _contenders(weight, h, target):
    """``{name: zero-argument loss}`` for every contender importable here."""
    import torch.nn.functional as F

    import bigdense as bd

    out = {"torch": lambda: F.cross_entropy(F.linear(h, weight).float(), target)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda: liger(weight, h, target)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = lambda: linear_cross_entropy(h, weight, target)
    except ImportError:
        pass
    head = bd.ParallelClassifierHead(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                     dtype=weight.dtype)
    head.weight = weight  # the same parameter for every contender
    out["bigdense"] = lambda: head.loss(h, target)
    return out


def _time(loss_fn, tensors, iters: int) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before) of forward + backward."""
    def call():
        for t in tensors:
            t.grad = None
        loss_fn().backward()

    for _ in range(3):
        call()
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**30


def run(iters: int = 10, profile: bool = False, device=None) -> list[dict]:
    import bigdense as bd

    device = device or torch.device("cuda")
    bd.set_default_context(None)
    rate = gemm_tflops(device)
    print(f"head peers on {torch.cuda.get_device_name(device)}: bf16 GEMM {rate:.0f} TFLOP/s; "
          f"fwd+bwd of linear + mean cross-entropy, bf16, median of {iters}")
    rows = []
    for tokens, d, classes in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        weight = torch.nn.Parameter((torch.randn(classes, d, device=device, generator=gen) * d**-0.5).to(torch.bfloat16))
        h = torch.randn(tokens, d, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        target = torch.randint(0, classes, (tokens,), device=device, generator=gen)
        floor_ms = 6 * tokens * d * classes / (rate * 1e12) * 1e3
        shape = f"{tokens:,} x {d:,} -> {classes:,}"
        print(f"{shape}: three-GEMM floor {floor_ms:.1f} ms")
        with bd.set_checks(False):
            for name, loss_fn in _contenders(weight, h, target).items():
                try:
                    ms, peak = _time(loss_fn, (weight, h), iters)
                except Exception as err:  # noqa: BLE001 - one failing peer must not hide the others
                    print(f"  {name:10s} failed: {type(err).__name__}: {err}")
                    continue
                print(f"  {name:10s} {ms:8.1f} ms  {peak:6.2f} GiB  {ms / floor_ms:5.2f}x floor")
                rows.append(dict(bench="gpu", case="head_peers", contender=name, tokens=tokens, d=d, classes=classes,
                                 ms=ms, peak_gib=peak, floor_ms=floor_ms, gemm_tflops=rate,
                                 device=torch.cuda.get_device_name(device)))
            if profile and (tokens, d, classes) == SHAPES[0]:
                _profile(_contenders(weight, h, target)["bigdense"], (weight, h))
        del weight, h, target
        torch.cuda.empty_cache()
    return rows


def _profile(loss_fn, tensors) -> None:
    from torch.profiler import ProfilerActivity, profile

    for t in tensors:
        t.grad = None
    loss_fn().backward()
    torch.cuda.synchronize()
    for t in tensors:
        t.grad = None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss_fn().backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
