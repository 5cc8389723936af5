"""Every classifier-head mode next to its GEMM floor and a Partial FC contender, at millions of classes.

    python -m bigdense.bench.head_floor                          # 131,072 / 1,000,000 / 4,000,000 classes
    python -m bigdense.bench.head_floor --classes 131072 --iters 2 --warmup 1   # one size, quicker
    python -m bigdense.bench.head_floor --classes 1000000 --chunk-gemms 8 16 32 64 128 256   # GEMMs by chunk
    python -m bigdense.bench.head_floor --classes 1000000 --chunk-passes   # ns per logit of each pass

Per class count, on 2 gloo CPU ranks with 1 thread each, fp32, ``--tokens`` tokens in all (4,096), d=128,
forward + backward with the input requiring grad, the same weights and inputs everywhere:

* ``floor``: what each rank must do at least for the exact heads -- the three matmuls (logits, input
  gradient, weight gradient) of (tokens x d) by (d x its classes) in plain ``torch.mm``/``addmm_``,
  class tile by class tile with the best of a few cache-sized tiles (chosen on a slice of the classes
  first). No softmax, no communication, no buffers to zero.
* ``tp``: ``shard="tp"`` at tp=2; every rank all the tokens.
* ``world``: ``shard="world"`` at tp=1 x dp=2; each rank half the tokens, gathered, so every rank
  scores all of them against its half of the classes: the same work per rank as ``tp``.
* ``floor-sampled``: the floor's matmuls over the classes a sampled head scores on that rank at
  ``--rate`` (the targets of the batch plus each other class with probability r).
* ``sampled``: ``shard="world"``, ``sample_rate=--rate``, CosFace; ``sampled-step`` adds an AdamW
  step of the head (the training step of the issue's largest case; its peak is the one to read).
* ``partial-fc``: Partial FC's algorithm (An et al., "Killing Two Birds with One Stone", CVPR 2022)
  written from the paper for measurement: the features and labels all-gathered, positive classes plus
  uniformly drawn negatives up to r x the rank's classes, the sampled rows gathered, CosFace on the
  normalised logits held whole, a softmax over ranks by all-reduced max and sum. Skipped (and said so)
  where its logits would not fit in this machine's memory.

Each mode runs in its own pair of spawned processes (``--start-method fork`` starts them faster for
tests, their RSS then including this process's pages). Printed per mode: the median time (each
iteration's slowest rank), its ratio to its floor, peak RSS per rank (VmHWM) and host synchronisations
per call with `bd.set_checks(False)` (counted by `bigdense.testing.OpCounter` on one extra call of
``--sync-tokens`` tokens, after a first call that may set up capacities);
then the issue's ratios: world / tp, sampled / Partial FC time and memory. ``--json PATH`` appends
one object per row. For reading, never for asserting.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import SEED, append_json_lines, peak_rss_bytes

MODES = ("floor", "tp", "world", "floor-sampled", "sampled", "sampled-step", "partial-fc")
DEFAULT_CLASSES = (131_072, 1_000_000, 4_000_000)
COSFACE_MARGIN, SCALE = 0.35, 64.0


# ---- inputs, the same for every mode ----------------------------------------------------------
def _inputs(args, classes):
    """Every token of the step: h (tokens, d) and target (tokens,)."""
    g = torch.Generator().manual_seed(SEED + 1)
    h = torch.randn(args.tokens, args.features, generator=g)
    target = torch.randint(0, classes, (args.tokens,), generator=g)
    return h, target


def _own_rows(n: int):
    """This DP rank's rows of ``n`` tokens (balanced split over the world)."""
    from bigdense.parallel.sharding import shard_sizes

    sizes = shard_sizes(n, dist.get_world_size())
    start = sum(sizes[: dist.get_rank()])
    return slice(start, start + sizes[dist.get_rank()])


def _class_range(classes: int):
    from bigdense.parallel.sharding import shard_sizes

    sizes = shard_sizes(classes, dist.get_world_size())
    start = sum(sizes[: dist.get_rank()])
    return start, start + sizes[dist.get_rank()]


def _fill_weight(weight: torch.Tensor, classes: int, start: int, args) -> None:
    from bigdense.layers.init import INITIALIZERS

    INITIALIZERS["torch"].init_(weight, (classes, args.features), (start, 0), SEED)


def _timed(step, args) -> list[float]:
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


# ---- the floor: three tiled matmuls ----------------------------------------------------------
CLASS_TILES = (1024, 4096, 16384)
TOKEN_TILES = (256, 1024, 4096)


def _three_matmuls(w, h, grad_w, grad_h, class_tile: int, token_tile: int, z) -> None:
    """Logits, input gradient and weight gradient of ``h`` (n, d) by ``w`` (c, d), class tile by
    class tile (the weight tile and its gradient stay in cache while the tokens stream by)."""
    n = h.shape[0]
    for c0 in range(0, w.shape[0], class_tile):
        wt, gwt = w[c0 : c0 + class_tile], grad_w[c0 : c0 + class_tile]
        for n0 in range(0, n, token_tile):
            ht = h[n0 : n0 + token_tile]
            zt = torch.mm(wt, ht.t(), out=z[: wt.shape[0] * ht.shape[0]].view(wt.shape[0], ht.shape[0]))
            if c0 == 0:
                torch.mm(zt.t(), wt, out=grad_h[n0 : n0 + token_tile])
            else:
                grad_h[n0 : n0 + token_tile].addmm_(zt.t(), wt)
            if n0 == 0:
                torch.mm(zt, ht, out=gwt)
            else:
                gwt.addmm_(zt, ht)


def _best_tiles(h, args, rows: int):
    """The fastest (class tile, token tile) on a slice of ``rows`` classes (at least one tile's worth)."""
    w = torch.randn(rows, args.features)
    grad_w, grad_h = torch.empty_like(w), torch.empty_like(h)
    z = torch.empty(max(CLASS_TILES) * max(TOKEN_TILES))
    best = None
    for ct in CLASS_TILES:
        for nt in TOKEN_TILES:
            _three_matmuls(w, h, grad_w, grad_h, ct, nt, z)  # warm
            start = time.perf_counter()
            _three_matmuls(w, h, grad_w, grad_h, ct, nt, z)
            elapsed = time.perf_counter() - start
            best = min(best or (elapsed, ct, nt), (elapsed, ct, nt))
    return best[1], best[2]


def _floor_rank(args, classes, rate):
    from bigdense.layers.head.sampling import sampled_class_mask
    from bigdense.parallel.random import draw_seed

    torch.set_num_threads(1)
    h, target = _inputs(args, classes)
    start, stop = _class_range(classes)
    rows = stop - start
    if rate < 1.0:  # the classes a sampled head scores here, for the same batch
        torch.manual_seed(SEED)
        rows = int(sampled_class_mask(draw_seed(), target, start, stop, rate).sum())
    ct, nt = _best_tiles(h, args, min(rows, 32768))
    w = torch.empty(rows, args.features)
    _fill_weight(w, classes, start, args)
    grad_w, grad_h = torch.empty_like(w), torch.empty_like(h)
    z = torch.empty(ct * nt)
    times = _timed(lambda: _three_matmuls(w, h, grad_w, grad_h, ct, nt, z), args)
    return dict(times=times, rss=peak_rss_bytes(), rows=rows, tiles=(ct, nt), syncs=None, loss=None)


# ---- bigdense's head in each mode --------------------------------------------------------------
def _head_rank(args, classes, mode):
    import bigdense as bd
    from bigdense.testing import OpCounter

    torch.set_num_threads(1)
    world = mode != "tp"
    ctx = bd.init_parallel(tp=1 if world else 2)
    sampled = mode.startswith("sampled")
    head = bd.ParallelClassifierHead(
        args.features, classes, bias=False, shard="world" if world else "tp", device="meta",
        sample_rate=args.rate if sampled else 1.0, margin="cosface" if sampled else None,
    )
    head.to_empty(device="cpu")
    _fill_weight(head.weight, classes, head.class_start, args)
    h, target = _inputs(args, classes)
    if world:
        own = _own_rows(args.tokens)
        h, target = h[own].contiguous(), target[own].contiguous()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, fused=True) if mode == "sampled-step" else None
    torch.manual_seed(SEED)
    losses = []

    def step(tokens=None):
        x = h[:tokens].clone().requires_grad_()
        loss = head.loss(x, target[:tokens])
        loss.backward()
        if opt is not None:
            opt.step()
        losses.append(loss.detach())
        head.zero_grad(set_to_none=True)

    times = _timed(step, args)
    # Counted on the first --sync-tokens tokens: the same code path as a whole batch, in a fraction
    # of its time. A world head would pad them to the token capacity its checked calls fixed; it
    # forgets it, so its first unchecked call below fixes one of --sync-tokens rows instead.
    head._dp_blocks.capacity = None
    with bd.set_checks(False):
        step(args.sync_tokens)  # a first call with checks off may fix what later calls reuse
        with OpCounter() as counted:
            step(args.sync_tokens)
    return dict(times=times, rss=peak_rss_bytes(), rows=None, tiles=None, syncs=counted.syncs,
                sync_ops=dict(counted.sync_ops), loss=float(losses[0]), dp=ctx.dp_size)


# ---- Partial FC, from its paper -----------------------------------------------------------------
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _GatherRows(torch.autograd.Function):
    """forward: all-gather equal row blocks; backward: all-reduce the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((dist.get_world_size() * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous())
        ctx.rows = x.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        rank = dist.get_rank()
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows]


class _DistSoftmaxCE(torch.autograd.Function):
    """Mean cross-entropy of logits split by class over the ranks (label -1: another rank's class);
    the softmax is formed in place and kept for the backward, as Partial FC does."""

    @staticmethod
    def forward(ctx, logits, label):
        top = logits.amax(dim=1, keepdim=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        logits.sub_(top).exp_()
        total = logits.sum(dim=1, keepdim=True)
        dist.all_reduce(total)
        logits.div_(total)
        here = label >= 0
        p_target = torch.zeros(logits.shape[0], 1)
        p_target[here] = logits[here].gather(1, label[here].unsqueeze(1))
        dist.all_reduce(p_target)
        ctx.save_for_backward(logits, label)
        return -p_target.clamp_min(1e-30).log().mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, label = ctx.saved_tensors
        here = label >= 0
        rows = here.nonzero().squeeze(1)
        softmax[rows, label[rows]] -= 1.0
        return softmax.mul_(grad / softmax.shape[0]), None


def _partial_fc_loss(weight, h, target, start, rate):
    embeddings = _GatherRows.apply(h)
    labels = torch.empty(embeddings.shape[0], dtype=target.dtype)
    _all_gather(labels, target)
    c_local = weight.shape[0]
    local = labels - start
    here = (local >= 0) & (local < c_local)
    positive = torch.unique(local[here])
    num_sample = max(int(rate * c_local), positive.numel())
    score = torch.rand(c_local)
    score[positive] = 2.0  # positives first, then random negatives
    index = score.topk(num_sample).indices.sort().values
    label = torch.full_like(labels, -1)
    label[here] = torch.searchsorted(index, local[here])
    logits = F.linear(F.normalize(embeddings), F.normalize(weight[index])).clamp(-1, 1)
    rows = (label >= 0).nonzero().squeeze(1)
    logits[rows, label[rows]] -= COSFACE_MARGIN
    return _DistSoftmaxCE.apply(logits * SCALE, label)


def partial_fc_bytes(args, classes) -> int:
    """Per rank, Partial FC's peak (measured 4.1 GB at 1M classes): about five copies of its logits
    (tokens x sampled classes) plus the weight, its gradient and the gathered rows."""
    sampled = args.rate * classes / 2
    return int(5 * args.tokens * sampled * 4 + 3 * classes / 2 * args.features * 4)


def _partial_fc_rank(args, classes):
    torch.set_num_threads(1)
    start, stop = _class_range(classes)
    weight = torch.empty(stop - start, args.features)
    _fill_weight(weight, classes, start, args)
    weight.requires_grad_()
    h, target = _inputs(args, classes)
    own = _own_rows(args.tokens)
    h, target = h[own].contiguous(), target[own].contiguous()
    torch.manual_seed(SEED + dist.get_rank())
    losses = []

    def step():
        x = h.clone().requires_grad_()
        loss = _partial_fc_loss(weight, x, target, start, args.rate)
        loss.backward()
        losses.append(loss.detach())
        weight.grad = None

    times = _timed(step, args)
    return dict(times=times, rss=peak_rss_bytes(), rows=None, tiles=None, syncs=None, loss=float(losses[0]))


# ---- why chunks are thick: the GEMMs of one chunk by its token count ------------------------------
def chunk_gemm_rates(args, classes: int) -> None:
    """GFLOP/s of one chunk's three matmuls (classes-major logits, input gradient, weight gradient,
    as the fused loss runs them) against one rank's shard of ``classes``, for each ``--chunk-gemms``
    token count, in this process on one thread: the measurement behind the CPU's smallest chunk."""
    torch.set_num_threads(1)
    rows = classes // 2
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(rows, args.features, generator=g)
    grad_w = torch.zeros_like(w)
    print(f"one chunk's GEMMs against {rows:,} classes x d={args.features}, 1 thread (GFLOP/s)", flush=True)
    for n in args.chunk_gemms:
        h = torch.randn(n, args.features, generator=g)
        z, grad_h = torch.empty(rows, n), torch.empty(n, args.features)
        gemms = {"logits W h^T": lambda: torch.mm(w, h.t(), out=z), "grad h z^T W": lambda: torch.mm(z.t(), w, out=grad_h),
                 "grad W += z h": lambda: grad_w.addmm_(z, h)}
        rates = {}
        for name, gemm in gemms.items():
            gemm()
            start = time.perf_counter()
            gemm()
            rates[name] = 2 * rows * n * args.features / (time.perf_counter() - start) / 1e9
        print(f"  {n:>5} tokens  " + "  ".join(f"{k} {v:5.1f}" for k, v in rates.items()), flush=True)
        if args.json:
            append_json_lines(args.json, [dict(suite="head_floor_chunk_gemms", classes=classes, tokens=n, gflops=rates)])


# ---- what is left above the floor: the softmax's passes over one chunk ----------------------------
def chunk_pass_costs(args, classes: int) -> None:
    """Nanoseconds per logit of each pass the fused fp32 loss makes over one automatic chunk's logits
    (one rank's shard of ``classes``, one thread), next to the chunk's three GEMMs: how far above
    the floor the exact heads must stay when their GEMMs run at its rate. Each in-place pass starts
    from the logits it would see in the loss (restored outside the timing)."""
    from bigdense.layers.head.ce_chunks import EXP_FLOOR, auto_chunk_size

    torch.set_num_threads(1)
    rows = classes // 2
    n = auto_chunk_size(rows, "cpu")
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(rows, args.features, generator=g) / math.sqrt(args.features)
    h = torch.randn(n, args.features, generator=g)
    logits = torch.mm(w, h.t())
    shift = logits.amax(0)
    shifted = logits - shift
    z, grad_w, grad_h = torch.empty_like(logits), torch.zeros_like(w), torch.empty_like(h)
    passes = {  # name: (the logits it starts from, the pass)
        "GEMM logits": (None, lambda: torch.mm(w, h.t(), out=z)),
        "GEMM grad h": (logits, lambda: torch.mm(z.t(), w, out=grad_h)),
        "GEMM grad W": (logits, lambda: grad_w.addmm_(z, h)),
        "max": (logits, lambda: z.amax(0)),
        "shift": (logits, lambda: z.sub_(shift)),
        "floor": (shifted, lambda: z.clamp_(min=EXP_FLOOR)),
        "exp": (shifted, lambda: z.exp_()),
        "sum": (shifted, lambda: z.sum(0)),
    }
    print(f"one chunk: {n} tokens x {rows:,} classes, 1 thread (ns per logit, best of 3)", flush=True)
    costs = {}
    for name, (start, one_pass) in passes.items():
        best = float("inf")
        for _ in range(3):
            if start is not None:
                z.copy_(start)
            begin = time.perf_counter()
            one_pass()
            best = min(best, time.perf_counter() - begin)
        costs[name] = best / logits.numel() * 1e9
        print(f"  {name:<12} {costs[name]:6.2f}", flush=True)
    gemms = sum(v for k, v in costs.items() if k.startswith("GEMM"))
    softmax = sum(v for k, v in costs.items() if not k.startswith("GEMM"))
    print(f"  softmax passes {softmax:.2f} ns per logit: {softmax / gemms:.1%} of the GEMMs' {gemms:.2f}", flush=True)
    if args.json:
        append_json_lines(args.json, [dict(suite="head_floor_chunk_passes", classes=classes, tokens=n,
                                           ns_per_logit=costs)])


# ---- the run ---------------------------------------------------------------------------------------
def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _run_mode(spawn, args, classes, mode):
    from bigdense.bench import head_floor as this

    if mode in ("floor", "floor-sampled"):
        return spawn(this._floor_rank, args, classes, args.rate if mode == "floor-sampled" else 1.0)
    if mode == "partial-fc":
        return spawn(this._partial_fc_rank, args, classes)
    return spawn(this._head_rank, args, classes, mode)


def _row(args, classes, mode, results) -> dict:
    per_iter = [max(ts) for ts in zip(*(r["times"] for r in results))]
    return dict(suite="head_floor", classes=classes, features=args.features, tokens=args.tokens, mode=mode,
                median_s=statistics.median(per_iter), times_s=per_iter,
                peak_rss_bytes=[r["rss"] for r in results], syncs_per_call=results[0]["syncs"],
                sync_ops=results[0].get("sync_ops"), floor_rows=[r["rows"] for r in results],
                floor_tiles=results[0]["tiles"], loss=results[0]["loss"])


def _print_row(row, floor_s) -> None:
    ratio = f"{row['median_s'] / floor_s:5.2f}x floor" if floor_s else " " * 11
    syncs = "" if row["syncs_per_call"] is None else f"  host syncs/call {row['syncs_per_call']}"
    rss = ", ".join(f"{b / 1e9:.2f}" for b in row["peak_rss_bytes"])
    extra = f"  tiles {row['floor_tiles']} rows {row['floor_rows']}" if row["floor_tiles"] else ""
    print(f"  {row['mode']:<14} median {row['median_s']:8.2f} s  [{', '.join(f'{t:.2f}' for t in row['times_s'])}]  "
          f"{ratio}  peak RSS/rank {rss} GB{syncs}{extra}", flush=True)


def _summary(rows: dict) -> None:
    def ratio(a, b):
        return rows[a]["median_s"] / rows[b]["median_s"] if a in rows and b in rows else None

    parts = []
    if ratio("world", "tp"):
        parts.append(f"world / tp {ratio('world', 'tp'):.2f}")
    if ratio("partial-fc", "sampled"):
        mem = max(rows["partial-fc"]["peak_rss_bytes"]) / max(rows["sampled"]["peak_rss_bytes"])
        parts.append(f"sampled {ratio('partial-fc', 'sampled'):.2f}x faster than Partial FC with 1/{mem:.1f} "
                     f"of its memory")
    if parts:
        print("  " + "; ".join(parts), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bigdense.bench.head_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, nargs="+", default=list(DEFAULT_CLASSES))
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the step, over both ranks")
    parser.add_argument("--rate", type=float, default=0.1, help="sample rate of the sampled modes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sync-tokens", type=int, default=256,
                        help="tokens per rank of the two extra calls that count host syncs with checks off")
    parser.add_argument("--chunk-gemms", type=int, nargs="+", metavar="TOKENS",
                        help="instead of the modes: the GFLOP/s of one chunk's three GEMMs at these token counts "
                             "(one thread, the first --classes split over two ranks)")
    parser.add_argument("--chunk-passes", action="store_true",
                        help="instead of the modes: ns per logit of each pass over one automatic chunk, GEMMs and "
                             "softmax (one thread, the first --classes split over two ranks)")
    parser.add_argument("--json", help="append one JSON object per row to this file")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "fork"),
                        help="how each mode's ranks start: spawn (default) gives each its own peak RSS; fork starts "
                             "in milliseconds but its RSS includes pages of this process (for tests)")
    args = parser.parse_args(argv)
    if args.tokens % 2:
        parser.error(f"--tokens must be even (two ranks), got {args.tokens}")
    if args.chunk_gemms:
        chunk_gemm_rates(args, args.classes[0])
        return
    if args.chunk_passes:
        chunk_pass_costs(args, args.classes[0])
        return

    from bigdense.testing import run_ranks

    def spawn(fn, *fn_args):
        return run_ranks(fn, 2, *fn_args, start_method=args.start_method, timeout=7200, collective_timeout=3600)

    print(f"classifier head modes vs their GEMM floor: d={args.features}, {args.tokens:,} tokens, fp32, 2 ranks x "
          f"1 thread, fwd+bwd, median of {args.iters} after {args.warmup} warm-up; sampled: r={args.rate}, CosFace")
    for classes in args.classes:
        print(f"{classes:,} classes", flush=True)
        rows, floors = {}, {}
        for mode in args.modes:
            if mode == "partial-fc" and 2 * partial_fc_bytes(args, classes) > 0.8 * _available_bytes():
                print(f"  {mode:<14} skipped: about {partial_fc_bytes(args, classes) / 1e9:.1f} GB per rank, "
                      f"{_available_bytes() / 1e9:.1f} GB available for two ranks", flush=True)
                continue
            row = _row(args, classes, mode, _run_mode(spawn, args, classes, mode))
            floor = floors.get("sampled" if mode.startswith(("sampled", "partial", "floor-s")) else "exact")
            if mode.startswith("floor"):
                floors["sampled" if mode == "floor-sampled" else "exact"] = row["median_s"]
                floor = None
            row["x_floor"] = row["median_s"] / floor if floor and mode != "sampled-step" else None
            _print_row(row, floor if mode != "sampled-step" else None)
            rows[mode] = row
        _summary(rows)
        if args.json:
            append_json_lines(args.json, list(rows.values()))


if __name__ == "__main__":
    main()
