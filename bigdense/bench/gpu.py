"""The reference GPT beside its Hugging Face twin, the MLP and the head on GPUs: step time, tokens/s,
MFU, how busy the GPU is, peak memory.

    python -m bigdense.bench.gpu --json gpu.jsonl            # about 5 minutes on one H100/H200
    python -m bigdense.bench.gpu --quick --json gpu.jsonl    # gpt_small only
    python -m bigdense.bench.gpu --peers [--profile]         # only the head against Liger, CCE, torch (bench/head_gpu.py)
    python -m bigdense.bench.gpu --finetune --json gpu.jsonl # only the fine-tuning case (bench/gpu_finetune.py)

On a CUDA machine, for ``gpt_small`` (124M) and ``gpt_1b`` (a ~1B-parameter config that fits one
device), batch 8 x 1024 tokens, dropout 0.1, bf16 autocast with fp32 master weights, the DDP
engine's ``train_step`` at tp = 1 in four modes:

* ``eager``;
* ``blocks``: each block compiled (``trainer.compile=blocks``: `compile_blocks`);
* ``model``: the whole forward and loss compiled (``trainer.compile=model``: `compile_model`);
* ``model+cuda_graphs``: that, and the whole step recorded once as a CUDA graph and replayed
  (``trainer.cuda_graphs``);

and ``eager`` and ``model`` at every TP size > 1 the GPUs allow (a divisor of the heads up to
``torch.cuda.device_count()``; one process per GPU on NCCL). Beside each model at tp = 1, its
peer: the Hugging Face GPT-2 of the same shape trained the same way, eager and under
``torch.compile`` (`bigdense.bench.gpu_peer`; skipped, saying so, without ``transformers``), and
the ratio of its step time to bigdense's: eager to eager, compiled to bigdense's fastest compiled
mode.

Every case runs as `bigdense.bench.gpu_profile.measure` does: warm-up steps (``--warmup``, 1;
compiled modes at least 2, CUDA graphs the engine's eager steps and the recording), ``--steps``
steps timed back to back with CUDA events, then ``--busy-steps`` under ``torch.profiler`` for
``gpu_busy``, the fraction of the step's wall time the GPU was working. Reported: step ms,
tokens/s, MFU (`bigdense.train.flops`: ``6N + 12 L d S`` FLOPs per token against the device's dense
bf16 peak), peak memory, ``gpu_busy`` and, compiled, the graphs the warm-up compiled and the graph
breaks (`bigdense.train.compile.GraphCounts`). Then the MLP and the vocab-parallel head on one GPU
against plain PyTorch (nn.Linear MLP; nn.Linear + F.cross_entropy on the full logits). Last,
within the budget (not with ``--quick``), the fine-tuning case (`bigdense.bench.gpu_finetune`):
one step of a 1.24B-parameter Llama with a 128,256-token vocabulary (Llama 3.2 1B's shape, random
weights), 4 x 2048 tokens, bigdense's ``CausalLM`` (its loss through the fused head; eager and
``trainer.compile=model``) through the DDP engine against transformers' own loss, Liger-Kernel's
patch and Cut Cross-Entropy (each where installed): step time and peak memory, and each peer's
ratios to bigdense eager (rows with ``case`` "finetune"; their fields in that module).

Results print as a table; ``--json`` appends one JSON object per result. GPT rows: ``case`` "gpt"
(bigdense; ``mode`` as above, ``compiled`` = mode is not eager) or "gpt_peer" (``peer``
"hf_gpt2", ``mode`` eager or compiled, ``compiled``, ``ratio_vs_bigdense`` = peer step ms /
bigdense step ms and ``vs_mode``, the bigdense mode compared), with ``model``, ``params``, ``tp``,
``step_ms``, ``tokens_per_s``, ``mfu``, ``peak_mem_gb``, ``gpu_busy``, ``gpu_kernel_ms``, ``loss``;
compiled, ``graphs_forward``, ``graphs_backward``, ``graph_breaks`` and ``recompiled_later``; a
case that failed or was skipped has ``error``. A run starts no new measurement after
``--budget-s`` seconds (240, for about 5 minutes in all: the last case started may compile for a
minute) and reports what it skipped; gpt_small runs first, and each model's comparisons with the
peer before its extra modes, so a short budget (or cold compile caches) skips those first.

Without CUDA it says so and runs a smoke test of the same code on CPU, then exits 0: model
``smoke``, fp32, one timed step of every case but ``model+cuda_graphs`` (skipped: no CUDA), the
compiled ones with the aot_eager backend; no step runs under the profiler (a CPU has no kernels
to time, and kineto would print its USDT lines), so ``gpu_busy`` is None; then the fine-tuning
case at tiny shapes (model ``smoke``; the peers skipped: their kernels need CUDA).
Needs torch only (transformers for the peer; no Hydra, no DeepSpeed): models are built from
dataclasses and configs, nothing is downloaded.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from . import append_json_lines
from .gpu_profile import measure, warm_profiler

MODELS = {
    "gpt_small": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, seq=1024, batch=8),
    "gpt_1b": dict(d_model=2048, n_layers=18, n_heads=16, vocab_size=50304, seq=1024, batch=8),
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512, seq=32, batch=2),
}
DROPOUT = 0.1  # embeddings, attention output, MLP output (the probabilities get none: SDPA's fused kernels)
MODES = ("eager", "blocks", "model", "model+cuda_graphs")  # bigdense at tp = 1
TP_MODES = ("eager", "model")  # tp > 1 (CUDA graphs record one process only)
PEER_MODES = ("eager", "compiled")
# The order of a model's cases at tp = 1: both comparisons with the peer first, so that a spent
# budget skips the extra modes rather than a ratio.
CASE_ORDER = (("gpt", "eager"), ("gpt_peer", "eager"), ("gpt", "model"), ("gpt_peer", "compiled"),
              ("gpt", "model+cuda_graphs"), ("gpt", "blocks"))
# On a CPU: every case but the CUDA graph one, compiled with aot_eager.
SMOKE_SKIPS = {("gpt", "model+cuda_graphs"): "skipped: CUDA graphs record GPU kernels; no CUDA here"}


@dataclass(frozen=True)
class Schedule:
    """How every case runs: untimed, timed and profiled steps, and the compile backend."""

    steps: int
    warmup: int
    busy_steps: int
    backend: str  # "inductor" on CUDA, "aot_eager" for the CPU smoke test (no C++ compiler needed)


def _warmup_steps(mode: str, asked: int) -> int:
    """Untimed steps before timing ``mode``: what was asked, and at least what leaves nothing to
    compile or record in the timed steps."""
    if mode == "model+cuda_graphs":
        from bigdense.train.cuda_graphs import WARMUP_STEPS

        return max(asked, WARMUP_STEPS + 1)  # the engine's eager steps, then the one that records
    if mode != "eager":
        return max(asked, 2)  # the first compiles forward and backward; the second shows nothing recompiles
    return asked


def _gpt_config(spec: dict):
    from bigdense.models.gpt import GPTConfig

    return GPTConfig(vocab_size=spec["vocab_size"], d_model=spec["d_model"], n_layers=spec["n_layers"],
                     n_heads=spec["n_heads"], max_seq_len=spec["seq"], dropout=DROPOUT, head_chunk_size=4096)


def _optim():
    from bigdense.config import OptimConfig

    return OptimConfig(warmup_steps=10)


def _precision(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def _tokens(spec: dict, device: torch.device) -> torch.Tensor:
    """The one batch every case trains on, (batch, seq) token ids; the same for every contender."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]), generator=gen).to(device)


def _gpt_case(model: str, tp: int, mode: str, sched: Schedule, device: torch.device, ctx) -> dict:
    """bigdense's GPT through the DDP engine in ``mode``, on this rank; the same row on every rank
    (step time: the slowest rank's)."""
    import bigdense as bd
    from bigdense.config import EngineConfig, PrecisionConfig
    from bigdense.models.gpt import GPT
    from bigdense.train.compile import compile_blocks, compile_model
    from bigdense.train.engines import EngineSettings, build_engine

    spec = MODELS[model]
    torch.manual_seed(0)
    with torch.device(device):
        net = GPT(_gpt_config(spec), tp_group=ctx.tp_group)
    if mode == "blocks":
        compile_blocks(net.blocks, sched.backend)
    elif mode in ("model", "model+cuda_graphs"):
        compile_model(net, sched.backend)
    precision = PrecisionConfig(dtype=_precision(device))
    settings = EngineSettings(engine=EngineConfig(), optim=_optim(), precision=precision,
                              micro_batch_size=spec["batch"], max_steps=10**6, cuda_graphs=mode == "model+cuda_graphs")
    engine = build_engine(net, ctx, settings)
    idx = _tokens(spec, device)
    batch = [(idx, idx.roll(-1, dims=1))]
    with bd.set_checks(False):  # the training loop's hot path: no host-side reads of the device
        measured = measure(lambda: engine.train_step(batch).raw["loss"], warmup=_warmup_steps(mode, sched.warmup),
                           steps=sched.steps, busy_steps=sched.busy_steps, device=device, count_graphs=mode != "eager")
    measured["step_s"] = _max_over_ranks(measured["step_s"], ctx, device)
    return _row("gpt", model, net.num_parameters()["total"], tp, device, measured, mode=mode, compiled=mode != "eager")


def _peer_case(model: str, mode: str, sched: Schedule, device: torch.device) -> dict:
    """The Hugging Face GPT-2 twin of ``model`` (`bigdense.bench.gpu_peer`), eager or compiled."""
    from . import gpu_peer

    spec, cfg, compiled = MODELS[model], _gpt_config(MODELS[model]), mode == "compiled"
    torch.manual_seed(0)
    twin = gpu_peer.build_twin(spec, cfg.dropout, cfg.attention_dropout, device)
    step = gpu_peer.twin_step(twin, _optim(), _tokens(spec, device), precision=_precision(device),
                              compiled=compiled, backend=sched.backend)
    with gpu_peer.compile_defaults(sched.backend) if compiled else contextlib.nullcontext():
        measured = measure(step, warmup=_warmup_steps(mode, sched.warmup), steps=sched.steps,
                           busy_steps=sched.busy_steps, device=device, count_graphs=compiled)
    n_params = sum(p.numel() for p in twin.parameters())  # a tied weight once, as bigdense counts it
    return _row("gpt_peer", model, n_params, 1, device, measured, peer=gpu_peer.PEER, mode=mode, compiled=compiled)


def _row(case: str, model: str, n_params: int, tp: int, device: torch.device, measured: dict, **labels) -> dict:
    """A GPT result: ``labels``, throughput and MFU from the measured step time, the measurement."""
    from bigdense.train.flops import flops_per_token, mfu, peak_tflops

    spec, measured = MODELS[model], dict(measured)
    step_s = measured.pop("step_s")
    tokens = spec["batch"] * spec["seq"]  # per step; TP ranks share the same tokens
    per_device = tokens / step_s / tp
    flops_token = flops_per_token(n_params, spec["n_layers"], spec["d_model"], spec["seq"])
    return dict(bench="gpu", case=case, model=model, **labels, params=n_params, tp=tp, precision=_precision(device),
                batch=spec["batch"], seq=spec["seq"], step_ms=step_s * 1e3, tokens_per_s=tokens / step_s,
                tokens_per_s_per_device=per_device, mfu=mfu(per_device, flops_token, peak_tflops(device)),
                **measured, device=_device_name(device))


def _stub(case: str, model: str, tp: int, mode: str, error: str) -> dict:
    """The row of a case that failed or was skipped."""
    row = dict(bench="gpu", case=case, model=model, tp=tp, mode=mode, compiled=mode != "eager", error=error)
    if case == "gpt_peer":
        from .gpu_peer import PEER

        row["peer"] = PEER
    return row


def _run_case(case: str, model: str, tp: int, mode: str, sched: Schedule, device: torch.device, ctx) -> dict:
    try:
        if case == "gpt_peer":
            return _peer_case(model, mode, sched, device)
        return _gpt_case(model, tp, mode, sched, device, ctx)
    except Exception:  # noqa: BLE001 - one failed case must not hide the others
        return _stub(case, model, tp, mode, traceback.format_exc(limit=3))
    finally:
        _release(device)


def _release(device: torch.device) -> None:
    """Free what a case held: its compiled code (which references the model), reference cycles
    (the engine and its CUDA graph), cached device memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max_over_ranks(value: float, ctx, device) -> float:
    if ctx.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _time_cuda(fn, iters: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms per call, peak GiB) of ``fn()`` on the current CUDA device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def _layer_cases(quick: bool) -> list[dict]:
    """The MLP and the head at tp=1 on one GPU, bf16 autocast, against plain PyTorch."""
    import torch.nn.functional as F

    import bigdense as bd
    from bigdense.layers.mlp import DenseMLP

    device = torch.device("cuda")
    iters = 10 if quick else 30
    out = []
    torch.manual_seed(0)
    d, hidden = 4096, 16384
    x = torch.randn(8, 1024, d, device=device, requires_grad=True)
    dense = DenseMLP(d, hidden, "gelu", device=device)
    ours = bd.ParallelMLP.from_dense(dense)

    def mlp_step(module):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                module(x).float().square().mean().backward()
        return run

    for name, module in (("torch nn.Linear MLP (baseline)", dense), ("bigdense ParallelMLP", ours)):
        ms, peak = _time_cuda(mlp_step(module), iters)
        out.append(dict(bench="gpu", case="mlp", contender=name, shape=f"x (8, 1024, {d}) -> {hidden} -> {d}",
                        ms=ms, peak_mem_gb=peak, device=_device_name(device)))
    del x, dense, ours
    tokens, d, classes = 8192, 2048, 131072
    h = torch.randn(tokens, d, device=device, requires_grad=True)
    target = torch.randint(0, classes, (tokens,), device=device)
    linear = torch.nn.Linear(d, classes, bias=False, device=device)
    head = bd.ParallelClassifierHead.from_dense(linear)

    def head_step(loss_fn):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_fn().backward()
        return run

    with bd.set_checks(False):
        for name, loss_fn in (
            ("torch linear + F.cross_entropy (baseline)", lambda: F.cross_entropy(linear(h).float(), target)),
            ("bigdense ParallelClassifierHead.loss", lambda: head.loss(h, target)),
        ):
            ms, peak = _time_cuda(head_step(loss_fn), iters)
            out.append(dict(bench="gpu", case="head", contender=name, shape=f"{tokens} tokens, {d} -> {classes} classes",
                            ms=ms, peak_mem_gb=peak, device=_device_name(device)))
    return out


def _cases(args, n_gpus: int, peer_skip: str | None) -> list[tuple]:
    """(case, model, tp, mode) in the order they run: tp = 1 by `CASE_ORDER`, then tp > 1."""
    models = ["gpt_small"] if args.quick else ["gpt_small", "gpt_1b"]
    out = [(case, model, 1, mode) for model in models for case, mode in CASE_ORDER
           if case == "gpt" or peer_skip is None]
    for model in models:
        heads = MODELS[model]["n_heads"]
        for tp in (t for t in (2, 4, 8) if t <= n_gpus and heads % t == 0):
            out += [("gpt", model, tp, mode) for mode in TP_MODES]
    return out


def _worker(rank: int, world: int, port: int, cases: list, sched: Schedule, queue) -> None:
    """One rank of a tp=world run on NCCL: every case, results (rank 0's) into ``queue``."""
    import datetime

    import torch.distributed as dist

    import bigdense as bd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    ctx = bd.init_parallel(tp=world)
    for case, model, tp, mode in cases:
        result = _run_case(case, model, tp, mode, sched, torch.device("cuda", rank), ctx)
        if rank == 0:
            queue.put(result)
    dist.destroy_process_group()


def _run_tp(world: int, cases: list, sched: Schedule, budget_s: float) -> list[dict]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_worker, args=(r, world, port, cases, sched, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.time() + budget_s
    while len(results) < len(cases) and time.time() < deadline and any(p.is_alive() for p in procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: poll again
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    done = {(r["case"], r["model"], r["tp"], r["mode"]) for r in results}
    return results + [_stub(*c, error="skipped: time budget") for c in cases if c not in done]


def _display_order(row: dict) -> tuple:
    modes = MODES + PEER_MODES
    return (list(MODELS).index(row["model"]), row["tp"], row["case"] == "gpt_peer",
            modes.index(row["mode"]) if row["mode"] in modes else len(modes))


def _gpt_table(rows: list[dict]) -> None:
    print(f"{'model':10s} {'params':>8s} {'tp':>3s} {'run':26s} {'step ms':>9s} {'tokens/s':>11s} {'tok/s/dev':>10s} "
          f"{'MFU':>6s} {'peak GiB':>9s} {'GPU busy':>8s}  graphs fw/bw/breaks")
    for r in sorted(rows, key=_display_order):
        run = f"{'bigdense' if r['case'] == 'gpt' else r['peer']} {r['mode']}"
        if "error" in r:
            last = r["error"].strip().splitlines()[-1]
            why = last if last.startswith("skipped") else f"failed: {last}"
            print(f"{r['model']:10s} {'':>8s} {r['tp']:3d} {run:26s} {why}")
            continue
        util = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "-"
        busy = f"{r['gpu_busy']:.0%}" if r.get("gpu_busy") is not None else "-"
        graphs = f"{r['graphs_forward']}/{r['graphs_backward']}/{r['graph_breaks']}" if "graphs_forward" in r else "-"
        print(f"{r['model']:10s} {r['params'] / 1e6:7.1f}M {r['tp']:3d} {run:26s} {r['step_ms']:9.1f} "
              f"{r['tokens_per_s']:11,.0f} {r['tokens_per_s_per_device']:10,.0f} {util:>6s} {peak:>9s} "
              f"{busy:>8s}  {graphs}")


def _ratio_lines(rows: list[dict]) -> None:
    peers = [r for r in rows if r.get("case") == "gpt_peer" and "ratio_vs_bigdense" in r]
    if not peers:
        return
    print("Hugging Face GPT-2 step ms / bigdense step ms (above 1: bigdense is faster):")
    for r in sorted(peers, key=_display_order):
        theirs = "torch.compile(model)" if r["compiled"] else "eager"
        ours = f"{r['vs_mode']} (its fastest compiled mode)" if r["compiled"] else r["vs_mode"]
        print(f"  {r['model']:10s} {r['peer']} {theirs} / bigdense {ours}: {r['ratio_vs_bigdense']:.2f}")


def _print_table(results: list[dict]) -> None:
    gpt = [r for r in results if r.get("case") in ("gpt", "gpt_peer")]
    if gpt:
        _gpt_table(gpt)
        _ratio_lines(gpt)
    from .gpu_finetune import print_table as finetune_table

    finetune_table([r for r in results if r.get("case") == "finetune"])
    for r in results:
        if r.get("case") not in ("gpt", "gpt_peer", "finetune") and "error" in r:
            print(f"{r['case']}: {r['error'].strip().splitlines()[-1]}")
    for case in ("mlp", "head"):
        rows = [r for r in results if r.get("case") == case and "error" not in r]
        if rows:
            print(f"{case}: {rows[0]['shape']}, bf16 autocast, forward + backward, median")
            for r in rows:
                print(f"  {r['contender']:45s} {r['ms']:8.2f} ms   peak {r['peak_mem_gb']:6.2f} GiB")
            print(f"  ratio bigdense / torch: {rows[1]['ms'] / rows[0]['ms']:.2f} (time), "
                  f"{rows[1]['peak_mem_gb'] / rows[0]['peak_mem_gb']:.2f} (peak memory)")


def _smoke(finetune_only: bool = False) -> list[dict]:
    """The CPU smoke test: `CASE_ORDER` less `SMOKE_SKIPS` on model ``smoke`` (not with
    ``finetune_only``), then the fine-tuning case's, one timed step each."""
    import bigdense as bd

    from .gpu_peer import add_ratios, available

    print("bigdense.bench.gpu: no CUDA device here; running a smoke test of the benchmark on CPU "
          "(no GPU figures).")
    ctx, device = bd.init_parallel(tp=1), torch.device("cpu")
    sched = Schedule(steps=1, warmup=1, busy_steps=0, backend="aot_eager")  # busy_steps: the module docstring
    peer_skip = available()
    rows = []
    for case, mode in () if finetune_only else CASE_ORDER:
        if (case, mode) in SMOKE_SKIPS:
            rows.append(_stub(case, "smoke", 1, mode, SMOKE_SKIPS[case, mode]))
        elif case == "gpt_peer" and peer_skip:
            rows.append(_stub(case, "smoke", 1, mode, f"skipped: {peer_skip}"))
        else:
            rows.append(_run_case(case, "smoke", 1, mode, sched, device, ctx))
    add_ratios(rows)
    rows += _finetune(ctx, "smoke", device, sched, deadline=float("inf"))
    return [dict(r, smoke=True) for r in rows]


def _finetune(ctx, model: str, device: torch.device, sched: Schedule, deadline: float) -> list[dict]:
    """The fine-tuning case (`bigdense.bench.gpu_finetune`), measured as every case is."""
    from . import gpu_finetune

    return gpu_finetune.run(ctx, model, device, sched, precision=_precision(device), warmup_steps=_warmup_steps,
                            release=_release, deadline=deadline)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gpt_small only")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case, back to back")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (compiled modes: at least 2; CUDA graphs: the engine's eager "
                             "steps and the recording)")
    parser.add_argument("--busy-steps", type=int, default=3,
                        help="steps under torch.profiler for gpu_busy (0: not measured)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new measurement after this")
    parser.add_argument("--json", help="append one JSON object per result to this file")
    parser.add_argument("--peers", action="store_true",
                        help="only the fused linear + cross-entropy against torch, Liger and Cut Cross-Entropy "
                             "(bench/head_gpu.py; the gpu-peers extra installs the peers)")
    parser.add_argument("--finetune", action="store_true",
                        help="only the fine-tuning case: a 1B Llama, bigdense's CausalLM against transformers, Liger "
                             "and Cut Cross-Entropy (bench/gpu_finetune.py)")
    parser.add_argument("--profile", action="store_true", help="--peers: the top kernels of one bigdense call")
    parser.add_argument("--head-iters", type=int, default=10, help="--peers: timed calls per contender")
    args = parser.parse_args(argv)
    started = time.time()

    if not torch.cuda.is_available():
        _emit(_smoke(finetune_only=args.finetune), args)
        return 0

    if args.peers:
        from . import head_gpu

        _emit(head_gpu.run(args.head_iters, args.profile), args)
        return 0
    from .gpu_peer import add_ratios, available

    n_gpus = torch.cuda.device_count()
    print(f"bigdense.bench.gpu: {n_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"TP sizes up to {n_gpus}")
    peer_skip = available()
    if peer_skip:
        print(f"  the Hugging Face GPT-2 peer is skipped: {peer_skip}")
    device, sched = torch.device("cuda", 0), Schedule(args.steps, args.warmup, args.busy_steps, "inductor")
    if args.busy_steps > 0 and (why := warm_profiler(device)):
        print(f"  the profiler failed to start ({why}); gpu_busy will be missing")
    if args.finetune:
        import bigdense as bd

        _emit(_finetune(bd.init_parallel(tp=1), "llama_1b", device, sched, started + args.budget_s), args)
        return 0
    cases = _cases(args, n_gpus, peer_skip)
    results: list[dict] = []
    if peer_skip:
        models = {c[1] for c in cases}
        results += [_stub("gpt_peer", model, 1, mode, f"skipped: {peer_skip}")
                    for model in sorted(models) for mode in PEER_MODES]
    import bigdense as bd

    ctx = bd.init_parallel(tp=1)
    for case, model, tp, mode in [c for c in cases if c[2] == 1]:
        if time.time() - started > args.budget_s:
            results.append(_stub(case, model, tp, mode, "skipped: time budget"))
            continue
        results.append(_run_case(case, model, tp, mode, sched, device, ctx))
        print(f"  done: {model} tp={tp} {'bigdense' if case == 'gpt' else 'peer'} {mode} "
              f"({time.time() - started:.0f} s)", flush=True)
    if time.time() - started > args.budget_s:
        results.append(dict(bench="gpu", case="layers", error="skipped: time budget"))
    else:
        try:
            results.extend(_layer_cases(args.quick))
        except Exception:  # noqa: BLE001
            results.append(dict(bench="gpu", case="layers", error=traceback.format_exc(limit=3)))
    for tp in sorted({c[2] for c in cases if c[2] > 1}):
        tp_cases = [c for c in cases if c[2] == tp]
        left = args.budget_s - (time.time() - started)
        if left <= 0:
            results += [_stub(*c, error="skipped: time budget") for c in tp_cases]
            continue
        results.extend(_run_tp(tp, tp_cases, sched, max(30.0, left)))
    if not args.quick:
        results.extend(_finetune(ctx, "llama_1b", device, sched, started + args.budget_s))
    add_ratios(results)
    _emit(results, args)
    return 0


def _emit(results: list[dict], args) -> None:
    _print_table(results)
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
