"""Sequence-parallel layers against unsharded twins (sequence_parallel_cases.py), at tp = 1..4 with sequences that do
not divide tp (and shorter than tp: empty shares); overlap on/off; the order of the overlapped
collectives; layout-free dropout on sequence shares; bad input."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bigdense as bd
from bigdense.testing import RankError, run_ranks
from sequence_parallel_cases import D_IN, layers_match, rank_share


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_sequence_parallel_layers_match_unsharded_twins(tp):
    assert all(run_ranks(layers_match, tp, tp))


def _grads_with_overlap(tp, overlap, sequence_parallel):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    mlp = bd.ParallelMLP(D_IN, 12, "swiglu", sequence_parallel=sequence_parallel, overlap_comm=overlap)
    x = torch.randn(3, 9, D_IN)
    x = (rank_share(x, ctx) if sequence_parallel else x).requires_grad_()
    (mlp(x, seq_len=9) ** 2).sum().backward()
    return [x.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlap_on_and_off_give_bit_identical_gradients(sequence_parallel):
    on = run_ranks(_grads_with_overlap, 2, 2, True, sequence_parallel)
    off = run_ranks(_grads_with_overlap, 2, 2, False, sequence_parallel)
    for rank in range(2):
        for a, b in zip(on[rank], off[rank]):
            assert torch.equal(a, b)


class _GemmLog(TorchDispatchMode):
    """Appends each matrix product to the collective counter's event list, interleaving them."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.events.append(("gemm", tuple(args[-2].shape), tuple(args[-1].shape)))
        return func(*args, **(kwargs or {}))


def _backward_events(sequence_parallel):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    col = bd.ColumnParallelLinear(D_IN, 8, sequence_parallel=sequence_parallel)
    x = torch.randn(2, 6, D_IN)
    x = (rank_share(x, ctx) if sequence_parallel else x).requires_grad_()
    y = col(x, seq_len=6)
    with bd.count_collectives() as counts, _GemmLog(counts.events):
        y.backward(torch.ones_like(y))
    return counts.events


def test_column_backward_overlaps_its_collectives_with_the_gemms():
    """From the event log: each collective is issued before a GEMM and waited for after it."""
    # Replicated input: grad_x GEMM, issue all-reduce, weight-grad GEMM, wait.
    events = run_ranks(_backward_events, 2, False)[0]
    kinds = [e[0] if e[0] == "gemm" else f"{e[0]} {e[1]}" for e in events]
    assert kinds == ["gemm", "issue all_reduce", "gemm", "wait all_reduce"], events
    # Sequence parallel: issue the re-gather, grad_x GEMM (from the output grad and the weight),
    # wait for the gather, issue the reduce-scatter, weight-grad GEMM (with the gathered input), wait.
    events = run_ranks(_backward_events, 2, True)[0]
    kinds = [e[0] if e[0] == "gemm" else f"{e[0]} {e[1]}" for e in events]
    assert kinds == [
        "issue all_gather", "gemm", "wait all_gather", "issue reduce_scatter", "gemm", "wait reduce_scatter",
    ], events
    assert events[1][2] == (4, D_IN)  # grad_x = grad_y @ W: needs no input
    assert events[4][2] == (12, D_IN)  # grad_W = grad_y^T @ x over the whole gathered sequence


def test_dropout_on_sequence_shares_applies_rows_of_the_replicated_mask():
    x = torch.ones(3, 10, 6)
    torch.manual_seed(5)
    whole = bd.tp_dropout(x, 0.5)
    for offset, length in ((0, 4), (4, 3), (7, 3), (10, 0)):
        torch.manual_seed(5)
        share = bd.tp_dropout(x[:, offset : offset + length], 0.5, shard_dim=-2, global_size=10, offset=offset)
        assert torch.equal(share, whole[:, offset : offset + length])
    with bd.batch_slice(3, 6):  # rows 3..5 of a global batch of 6, and a sequence share of them
        torch.manual_seed(5)
        share = bd.tp_dropout(x[:, 4:7], 0.5, shard_dim=-2, global_size=10, offset=4)
    torch.manual_seed(5)
    global_batch = bd.tp_dropout(torch.ones(6, 10, 6), 0.5)
    assert torch.equal(share, global_batch[3:, 4:7])


def _wrong_share():
    ctx = bd.init_parallel(tp=2)
    col = bd.ColumnParallelLinear(4, 6, sequence_parallel=True)
    x = torch.randn(2, 3, 4)  # S=5 is shared (3, 2): rank 1's input is one row too long
    try:
        col(x, seq_len=5)
    except ValueError as e:
        return str(e)
    return None


def test_a_wrong_sequence_share_fails_on_every_rank_naming_layer_and_shapes():
    with bd.set_checks(True):
        messages = run_ranks(_wrong_share, 2)
    assert all(m is not None for m in messages), messages
    for m in messages:
        assert "ColumnParallelLinear(in_features=4, out_features=6, tp=2" in m
        assert "balanced share of the sequence S=5 along dim -2, [3, 2] in rank order" in m
        assert "got shares [3, 3]" in m


def test_sequence_parallel_without_a_process_group_runs_as_one_rank():
    torch.manual_seed(0)
    mlp = bd.ParallelMLP(D_IN, 8, sequence_parallel=True)
    x = torch.randn(2, 3, D_IN)
    ref = bd.ParallelMLP(D_IN, 8)
    ref.load_state_dict(mlp.state_dict())
    assert torch.equal(mlp(x), ref(x))
    with pytest.raises(ValueError, match=r"ParallelMLP\(d_model=5.*expects input \(\*, S_local, 5\)"):
        mlp(torch.randn(D_IN))
