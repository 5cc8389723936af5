"""The head's GPU path (`layers/head/ce_gpu.py`, kernels in `bigdense/kernels/`) on CPU.

Three layers of evidence, none needing a GPU:
1. each Triton kernel, run by Triton's interpreter (TRITON_INTERPRET=1, set by conftest), equals its
   torch reference (`bigdense.kernels.softmax_ce`) on small shapes with several column blocks, uneven
   tails, margins, label smoothing, a sample's -inf padding, ignored and off-shard targets, no class;
2. the kernels compile for an sm_90 GPU (Triton's own compiler, down to a cubin, no device needed);
3. the whole head, forced onto the GPU path (BIGDENSE_CE_KERNELS=triton) on CPU ranks, passes the
   head's own exactness cases against independent references (F.cross_entropy on full logits,
   InsightFace's margins, the single-process sampled softmax) at tp 1-3 with uneven shards, in every
   mode: tp and world sharding, sampling, margins, smoothing, ignore_index, the three reductions,
   both gradient strategies, a bias, bf16, sequence parallelism.
"""
import itertools
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from bigdense.kernels import softmax_ce  # noqa: E402
from bigdense.kernels.softmax_ce import KERNELS_ENV, STATS  # noqa: E402
from bigdense.testing import run_ranks  # noqa: E402

from head_cases import edges_are_identical_on_every_rank, loss_matches_reference  # noqa: E402
from head_cases import no_grad_evaluation_forms_no_gradients  # noqa: E402
from head_modes_cases import MODES, padded_equals_exact, syncs_per_mode  # noqa: E402
from head_xc_cases import margin_case, sampled_case, world_case  # noqa: E402
from helpers import compile_for_sm90_in_a_fresh_process  # noqa: E402
from sequence_parallel_cases import layers_match  # noqa: E402

# The interpreter evaluates log(0) = -inf (a rank with no class) with numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture
def kernel_path(monkeypatch):
    """The head's GPU path with the Triton kernels (interpreted) on CPU tensors, in this process and
    in the ranks it forks."""
    monkeypatch.setenv(KERNELS_ENV, "triton")


def _inputs(n, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, cols, generator=g) * 6).to(dtype)
    target = torch.randint(0, max(cols, 1), (n,), generator=g)
    target[::3] = -1  # off-shard or ignored
    offset = torch.randn(n, generator=g)
    real = torch.rand(cols, generator=g) > 0.25
    weight = torch.rand(n, generator=g)
    weight[1] = 0.0  # an ignored token
    return z, target, offset, real, weight


# fp32 kernels against fp32 references: the same operations in another order (an online max and
# blockwise rescaled sums against one pass over the row): a few ulps of O(1) values.
FP32 = dict(rtol=1e-5, atol=1e-6)
# bf16 logits: both sides read the same bf16 values and compute in fp32; the gradient is then stored
# in bf16. Triton's interpreter truncates that store (numpy's cast) where the torch reference -- and a
# GPU -- round to nearest, so the two may differ by one bf16 rounding step (2^-8 to 2^-7 relative):
# these cases cannot see how a GPU rounds, only that the kernel computes the same fp32 values. The
# tolerance is that one step, no wider.
BF16 = dict(rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [0, 1, 37, 64])
def test_kernels_equal_their_torch_references(dtype, cols):
    from bigdense.kernels import triton_ce

    tol = FP32 if dtype == torch.float32 else BF16
    for seed, (use_offset, use_real, smoothing) in enumerate(itertools.product((False, True), repeat=3)):
        z, target, offset, real, weight = _inputs(7, cols, dtype, seed)
        offset = offset if use_offset else None
        if use_real:
            z[:, ~real] = float("-inf")  # a sample's padding rows
            z[4] = float("-inf")  # a token with no real class here
        real = real if use_real else None
        what = f"{dtype} cols={cols} offset={use_offset} real={use_real} smoothing={smoothing}"
        ref = softmax_ce.row_stats(z, target, offset, real, smoothing, torch.empty(STATS, 7))
        got = triton_ce.row_stats(z, target, offset, real, smoothing, torch.empty(STATS, 7), block=16)
        torch.testing.assert_close(got, ref, **FP32, msg=lambda m: f"row_stats {what}: {m}")
        # Statistics of three ranks, one of which holds no class for these tokens.
        other = ref.clone()
        other[0] -= 1.5
        nothing = torch.zeros(STATS, 7)
        nothing[0] = float("-inf")
        stats = torch.stack([ref, other, nothing])
        eps = 0.1 if smoothing else 0.0
        smooth = torch.tensor(eps / 50) if smoothing else None
        want = softmax_ce.softmax_grad_(z.clone(), stats, target, offset, real, weight, eps, smooth)
        got = triton_ce.softmax_grad_(z.clone(), stats, target, offset, real, weight, eps, smooth, block=16)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"softmax_grad_ {what}: {m}")


def test_softmax_gradient_reference_is_the_cross_entropy_gradient():
    # The oracle itself (one rank, fp32 as the kernels compute) against autograd through
    # F.cross_entropy on the same logits in float64: fp32 round-off of O(1) values.
    z, target, _, _, weight = _inputs(6, 11, torch.float32, 3)
    target = target.clamp(min=0)
    eps = 0.2
    stats = softmax_ce.row_stats(z, target, None, None, True, torch.empty(STATS, 6))
    grad = softmax_ce.softmax_grad_(z.clone(), stats.unsqueeze(0), target, None, None, weight, eps,
                                    torch.tensor(eps / 11))
    zz = z.double().requires_grad_()
    losses = torch.nn.functional.cross_entropy(zz, target, label_smoothing=eps, reduction="none")
    (losses * weight.double()).sum().backward()
    torch.testing.assert_close(grad.double(), zz.grad, **FP32)


def test_kernels_compile_for_an_sm90_gpu():
    # The interpreter is lenient where the compiler is not (loop-carried types, constexpr branches):
    # compiling for Hopper, with no device, catches what only a GPU run would otherwise find. In a
    # fresh process: here the kernels were defined for the interpreter.
    compile_for_sm90_in_a_fresh_process("triton_ce", 18)  # two kernels x (8 input switch combinations + all on)


# ---- the whole head on the GPU path ----
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_head_loss_and_grads_match_cross_entropy_on_the_kernel_path(kernel_path, tp):
    # Every chunking, reduction, smoothing, strategy and bias; 24 / 29 / 3 classes (even, uneven, fewer
    # than tp); bf16 autocast and bf16 weights.
    if tp == 1:
        loss_matches_reference(1)
    else:
        run_ranks(loss_matches_reference, tp, tp, timeout=300)


def test_head_edges_on_the_kernel_path(kernel_path):
    results = run_ranks(edges_are_identical_on_every_rank, 3, 3)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("margin,tp", [("arcface", 1), ("cosface", 2), ((1.2, 0.2, 0.0), 3)])
def test_margins_match_insightface_on_the_kernel_path(kernel_path, margin, tp):
    run_ranks(margin_case, tp, margin)


@pytest.mark.parametrize("tp,world,shard", [(1, 1, "tp"), (2, 2, "tp"), (1, 2, "world"), (1, 3, "world")])
def test_sampling_and_world_sharding_on_the_kernel_path(kernel_path, tp, world, shard):
    run_ranks(sampled_case, world, 0.3 if world > 1 else 1.0, 0.1, shard, tp)


@pytest.mark.parametrize("margin,reduction", [(None, "mean"), ("arcface", "sum"), (None, "none")])
def test_world_sharded_head_equals_tp_head_on_the_kernel_path(kernel_path, margin, reduction):
    run_ranks(world_case, 2, margin, reduction)


def test_padding_of_a_sample_and_of_dp_blocks_on_the_kernel_path(kernel_path):
    run_ranks(padded_equals_exact, 2, (0, 5), 1, 0.1)


def test_every_mode_makes_no_host_sync_on_the_kernel_path(kernel_path):
    for rank in run_ranks(syncs_per_mode, 2, 2):
        assert rank == {name: {} for name in MODES}, rank


def test_sequence_parallel_head_on_the_kernel_path(kernel_path):
    # Sequence 7 (uneven over 3) and 2 (an empty share): the gathered sequence, the reduce-scattered grad_h.
    assert all(run_ranks(layers_match, 3, 3))


def test_importing_bigdense_imports_no_triton():
    # Triton is needed where a kernel runs, not to import the package or to run the CPU path.
    code = ("import sys, torch, bigdense as bd\n"
            "head = bd.ParallelClassifierHead(8, 11)\n"
            "head.loss(torch.randn(5, 8), torch.randint(0, 11, (5,))).backward()\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n")
    env = {k: v for k, v in os.environ.items() if k != KERNELS_ENV}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_wrong_kernel_choice_is_named(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=r"BIGDENSE_CE_KERNELS='cuda': expected one of \('triton', 'torch', 'off'\)"):
        softmax_ce.ce_kernels(torch.device("cpu"))


def test_no_grad_evaluation_forms_no_gradients_on_the_kernel_path(kernel_path, monkeypatch):
    no_grad_evaluation_forms_no_gradients(monkeypatch)


def _kernel_overlap_order():
    import bigdense as bd
    from bigdense.kernels.softmax_ce import CEKernels, ce_kernels
    from bigdense.layers.head import ce_gpu

    bd.init_parallel(tp=2)
    seen = []
    inner = ce_kernels(torch.device("cpu"))

    def softmax_grad_(*args, **kwargs):
        seen.append("grad")
        return inner.softmax_grad_(*args, **kwargs)

    ce_gpu.ce_kernels = lambda device: CEKernels("recorded", inner.row_stats, softmax_grad_)
    original = ce_gpu._logits
    ce_gpu._logits = lambda *args: (seen.append("logits"), original(*args))[1]
    start = ce_gpu.comm.all_gather_dim_start
    ce_gpu.comm.all_gather_dim_start = lambda *args: (seen.append("gather"), start(*args))[1]
    torch.manual_seed(0)
    head = bd.ParallelClassifierHead(16, 64, chunk_size=4)
    head.loss(torch.randn(12, 16, requires_grad=True), torch.randint(0, 64, (12,)))
    return seen


def test_gpu_loop_overlaps_each_gather_with_the_next_chunks_gemm(kernel_path):
    # Two logits buffers at tp > 1: chunk k's statistics are gathered before chunk k+1's GEMM and
    # its gradient kernel runs after it.
    order = run_ranks(_kernel_overlap_order, 2)[0]
    assert order == ["logits", "gather", "logits", "gather", "grad", "logits", "gather", "grad", "grad"], order
